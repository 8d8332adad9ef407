"""One chat or text completion's answer: its tokens, counted on its turn on a server slot, the
envelope of its stream's chunks, and the whole (not streamed) answers, in llama-server's shapes
(usage with the prompt's cached tokens, `timings`, `system_fingerprint`).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import orjson

from hal0d_stub.context import asked_max_tokens
from hal0d_stub.models import DEFAULT_MAX_TOKENS, first_tool_name, plan, shell_call, shell_result
from hal0d_stub.slots import Turn

SYSTEM_FINGERPRINT = "hal0d-stub"  # where llama-server names its build


class Generation:
    """One answer: tokens, limits, the chunk envelope, and its turn on a server slot."""

    def __init__(self, model: str, body: dict[str, Any], object_name: str, turn: Turn,
                 name: str | None = None, *, room: int = DEFAULT_MAX_TOKENS) -> None:
        self.model = model  # what it does: "tool" calls a tool, "stall" stalls...
        self.name = name or model  # what its answer calls the model (llama-server's --alias)
        self.body = body
        self.object = object_name
        self.turn = turn
        prefix = "chatcmpl" if object_name.startswith("chat") else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        # What it asked, or the default; never past the context's end (`room`).
        self.max_tokens = min(asked_max_tokens(body) or DEFAULT_MAX_TOKENS, room)
        self.completion_tokens = 0

    def count(self, piece: str) -> None:
        """One more generated token."""
        self.completion_tokens += 1
        self.turn.generated(piece)

    def chunk(self, choice: dict[str, Any], **extra: Any) -> bytes:
        payload = {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.name,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": [choice] if choice else [],
            **extra,
        }
        return b"data: " + orjson.dumps(payload) + b"\n\n"

    def usage(self) -> dict[str, Any]:
        prompt = len(self.turn.prompt)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.completion_tokens,
            "total_tokens": prompt + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.turn.cache_n},
        }

    def timings(self) -> dict[str, int | float]:
        return self.turn.timings(self.completion_tokens)


def generate_whole(gen: Generation) -> tuple[list[str], list[str], str]:
    """Reasoning and content tokens of a whole answer, and its finish_reason."""
    reasoning: list[str] = []
    content: list[str] = []
    for kind, text in plan(gen.model, gen.body):
        if gen.completion_tokens >= gen.max_tokens:
            return reasoning, content, "length"
        gen.count(text)
        (reasoning if kind == "reasoning_content" else content).append(text)
    return reasoning, content, "stop"


def complete_chat(gen: Generation) -> dict[str, Any]:
    finish = "stop"
    message: dict[str, Any] = {"role": "assistant"}
    if gen.model == "tool" or (gen.model == "shell" and shell_result(gen.body) is None):
        if gen.model == "tool":
            name, arguments = first_tool_name(gen.body), '{"query": "weather in Paris"}'
        else:
            name, shell_arguments = shell_call(gen.body)
            arguments = orjson.dumps(shell_arguments).decode()
        message["content"] = None
        message["tool_calls"] = [{
            "id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
            "function": {"name": name, "arguments": arguments},
        }]
        gen.completion_tokens = 3
        finish = "tool_calls"
    else:
        reasoning, content, finish = generate_whole(gen)
        message["content"] = "".join(content) if content else None
        if reasoning:
            message["reasoning_content"] = "".join(reasoning)
    return {
        "id": gen.id,
        "object": "chat.completion",
        "created": gen.created,
        "model": gen.name,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": gen.usage(),
        "timings": gen.timings(),
    }


def complete_text(gen: Generation) -> dict[str, Any]:
    reasoning, content, finish = generate_whole(gen)
    return {
        "id": gen.id, "object": "text_completion", "created": gen.created,
        "model": gen.name, "system_fingerprint": SYSTEM_FINGERPRINT, "usage": gen.usage(),
        "choices": [{"index": 0, "text": "".join(reasoning + content), "finish_reason": finish}],
        "timings": gen.timings(),
    }
