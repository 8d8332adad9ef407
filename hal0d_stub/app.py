"""The stub upstream: an OpenAI-compatible server for the demo, the tests and the benchmark.

It serves every endpoint hal0d dispatches, with small deterministic answers in the shapes the
real servers use: chat completions and completions (streamed and not), embeddings, audio speech
(a byte stream) and transcriptions (multipart; `response_format` json or text), image generations
(a tiny real PNG as `b64_json`), rerank (llama-server's and Jina's shape), llama-server's
/tokenize and /apply-template (a ChatML template with a default system prompt, which its usage
counts too, as a real server's does), the Responses API (/v1/responses, streamed as named events,
kept for GET and DELETE), and, made with `anthropic_native` (`hal0d stub --anthropic-native`),
the Anthropic Messages API natively. Chat completions stream SSE the way llama-server does (a
role-only first chunk, one chunk per token, a final chunk with finish_reason, a usage chunk when
`stream_options.include_usage` is set, `timings` on the last chunk, `data: [DONE]`). Both
completions run on llama-server's server slots and their prompt cache (slots.py: `--parallel`,
`id_slot`, `cache_prompt`, `timings`, `usage.prompt_tokens_details.cached_tokens`, a prefill paced
by the uncached tokens), with its GET /slots and POST /slots/{id}?action=save|restore|erase
(slot_api.py). Made with `props`, it describes itself at GET /props as llama-server does (the
tests hand it a capture of the real one), its n_ctx the one its slots hold. A prompt that does
not fit that context is refused as llama-server refuses it, and an answer stops where the context
is full (context.py); made with `max_model_len`, the stub checks as vLLM does instead.

It misbehaves on demand through the model name, on every endpoint, streamed or not:

    reasoning   reasoning_content tokens, then content tokens ("long" as the last user message:
                content until max_tokens)
    chat        content only          think-only  reasoning_content only
    tool        calls the first tool of the request (arguments streamed in fragments)
    shell       an agent's turn: asks for a shell command (SHELL_COMMAND) through the request's
                shell tool (Codex's exec_command, shell_command, shell or local_shell; else the
                first tool), and once the conversation ends with that tool's result, answers
                "The command printed: <the result>"
    stall       streamed: a few tokens (or audio frames), then silence with the connection open;
                not streamed: no answer at all, the connection left open
    chatty      streamed: content (or audio) forever, finish_reason always null;
                not streamed: never answers, since the answer never ends
    broken      streamed: a few tokens, then the connection is cut; not streamed: the headers and
                half the body, then the connection is cut

Only chat completions refuse a model name outside that list (404); the other endpoints answer any
name. Every error is JSON in OpenAI's envelope, unknown paths and oversized bodies included.

Each request appends lines to --log: `start`, then `end` or `cancelled` (the client went away
before the answer was complete), with `stalling` or `breaking` in between when the model asks for
it, and `slot-select` (the server slot a completion took, why, its cache_n and prompt_n); each
slot action one line (`slot-save`, `slot-restore`, `slot-erase`): the tests and the README's
commands read them.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import itertools
import struct
import sys
import time
import uuid
import zlib
from collections.abc import Awaitable, Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import orjson
from aiohttp import hdrs, web

from hal0d_stub.context import ContextLimit, asked_max_tokens, ctx_size, with_n_ctx
from hal0d_stub.device_load import DeviceLoad, claim
from hal0d_stub.slot_api import SlotApi
from hal0d_stub.slots import ServerSlots, SlotOptions, Turn, token_ids

MODELS = ("reasoning", "chat", "think-only", "tool", "stall", "chatty", "broken", "shell")
REASONING_TEXT = "The user greets me. A short friendly answer fits best here."
CONTENT_TEXT = "Hello! I am the hal0d stub upstream. How can I help you today?"
LONG_WORDS = ["and", "the", "model", "keeps", "talking", "about", "nothing", "in", "particular"]
TRANSCRIPT_TEXT = "Hello from the hal0d stub. This is what the audio said."
DEFAULT_MAX_TOKENS = 256
# The models that misbehave in the middle of a stream, after TOKENS_BEFORE_TROUBLE tokens (or
# audio frames).
MID_STREAM_TROUBLE = frozenset({"stall", "broken"})
TOKENS_BEFORE_TROUBLE = 3
# hal0d accepts request bodies up to its largest [server].max_body_bytes (4 GiB): the stub takes
# as much, so every body hal0d lets through reaches an upstream that answers it, instead of
# aiohttp's default 1 MiB refusing it with a 413 that reads as hal0d's own failure.
MAX_BODY_BYTES = 1 << 32


class StubLog:
    """Line-per-event log, flushed at once so a test can read it while the stub runs."""

    def __init__(self, path: Path | None) -> None:
        self._file = path.open("a", buffering=1, encoding="utf-8") if path else None

    def write(self, line: str) -> None:
        if self._file is not None:
            self._file.write(f"{time.time():.3f} {line}\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


LOG_KEY = web.AppKey("stub_log", StubLog)
DELAY_KEY = web.AppKey("stub_delay", float)
ALIASES_KEY = web.AppKey("stub_aliases", tuple)
SLOTS_KEY = web.AppKey("stub_slots", ServerSlots)
CONTEXT_KEY = web.AppKey("stub_context", ContextLimit)
SYSTEM_FINGERPRINT = "hal0d-stub"  # where llama-server names its build


def words(text: str) -> list[str]:
    """Split text into word tokens that keep their leading space, as tokenizers do."""
    parts = text.split(" ")
    return [parts[0]] + [" " + part for part in parts[1:]]


def last_user_text(messages: Any) -> str:
    if not isinstance(messages, list):
        return ""
    for message in reversed(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                return " ".join(
                    part.get("text", "") for part in content if isinstance(part, dict)
                )
    return ""


# The stub's chat template, ChatML as SmolLM2 and Qwen use it, with SmolLM2's habit of a default
# system prompt when the request has none: tens of tokens the messages' own text does not hold,
# which a count of the raw text misses.
SYSTEM_PREAMBLE = (
    "You are a helpful AI assistant named Stub, served by the hal0d stub upstream for demos and "
    "tests. You answer briefly and kindly, you call a tool only when the user asks for one, and "
    "you always greet the user first."
)


def message_text(content: Any) -> str:
    """A message's content as text: a string, or the text of its parts (OpenAI's and
    Anthropic's); any other part (a tool call or result) as its JSON."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return "" if content is None else str(content)
    texts = []
    for part in content:
        if isinstance(part, dict) and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            texts.append(orjson.dumps(part).decode())
    return " ".join(texts)


def apply_template(body: dict[str, Any]) -> str:
    """The prompt the stub's model reads for a chat request (OpenAI's shape, or Anthropic's with
    its top-level `system`), as llama-server's /apply-template answers it."""
    messages = [m for m in body.get("messages") or () if isinstance(m, dict)]
    system = body.get("system")
    if system is not None:
        messages = [{"role": "system", "content": system}, *messages]
    if not messages or messages[0].get("role") != "system":
        messages = [{"role": "system", "content": SYSTEM_PREAMBLE}, *messages]
    turns = []
    for index, message in enumerate(messages):
        text = message_text(message.get("content"))
        if index == 0 and body.get("tools"):
            text += "\nTools: " + orjson.dumps(body["tools"]).decode()
        for call in message.get("tool_calls") or ():
            text += "\n" + orjson.dumps(call).decode()
        turns.append(f"<|im_start|>{message.get('role')}\n{text}<|im_end|>\n")
    return "".join(turns) + "<|im_start|>assistant\n"


def count_tokens(text: str, *, add_special: bool) -> int:
    """The stub's tokenizer: a token per whitespace-separated word (a template marker is one
    word), and the BOS token when the special tokens are added."""
    return len(text.split()) + (1 if add_special else 0)


def prompt_text(body: dict[str, Any]) -> str:
    """What a completion reads: the templated prompt (a chat request) or the prompt as given (a
    legacy completion)."""
    if isinstance(body.get("messages"), list):
        return apply_template(body)
    return str(body.get("prompt", ""))


def prompt_tokens(body: dict[str, Any]) -> int:
    """What a completion reports as usage.prompt_tokens: its prompt tokenized as the completion
    does, BOS included."""
    return count_tokens(prompt_text(body), add_special=True)


def plan(model: str, body: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """The (kind, text) tokens the stub generates for a request, kind being a delta field."""
    if model in ("reasoning", "think-only"):
        yield from (("reasoning_content", w) for w in words(REASONING_TEXT))
    if model == "think-only":
        return
    if model == "shell":
        yield from (("content", w) for w in words(SHELL_ANSWER + (shell_result(body) or "")))
        return
    if model == "reasoning" and last_user_text(body.get("messages")).strip() == "long":
        yield from (("content", w) for w in itertools.cycle(words(" ".join(LONG_WORDS))))
    if model == "chatty":
        yield from (("content", w) for w in itertools.cycle(words(CONTENT_TEXT)))
    yield from (("content", w) for w in words(CONTENT_TEXT))


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


async def _pause(delay: float) -> None:
    # Yield to the loop even without pacing so cancellation and other requests get a turn.
    await asyncio.sleep(delay)


async def misbehave_mid_stream(request: web.Request, model: str, what: str) -> bool:
    """`stall` goes silent for good; `broken` cuts the connection (True: the answer is over)."""
    log = request.app[LOG_KEY]
    if model == "stall":
        log.write(f"stalling {what}")
        await asyncio.Event().wait()  # silence until the client goes away
    if model == "broken":
        log.write(f"breaking {what}")
        assert request.transport is not None
        request.transport.abort()
        return True
    return False


def sse_response() -> web.StreamResponse:
    return web.StreamResponse(
        headers={hdrs.CONTENT_TYPE: "text/event-stream", hdrs.CACHE_CONTROL: "no-cache"}
    )


async def stream_tokens(request: web.Request, gen: Generation, legacy: bool) -> web.StreamResponse:
    """A streamed chat completion (or, `legacy`, a /v1/completions text stream)."""
    body = gen.body
    delay = request.app[DELAY_KEY]
    response = sse_response()
    await response.prepare(request)
    await gen.turn.prefill()  # llama-server sends the head first, then reads the prompt
    if not legacy:
        await response.write(
            gen.chunk({"index": 0, "delta": {"role": "assistant", "content": None},
                       "finish_reason": None})
        )
    finish: str | None = "stop"
    if gen.model == "tool" and not legacy:
        await stream_tool_call(response, gen, delay)
        finish = "tool_calls"
    elif gen.model == "shell" and not legacy and shell_result(body) is None:
        name, arguments = shell_call(body)
        await stream_tool_call(response, gen, delay, name, fragments(orjson.dumps(arguments)))
        finish = "tool_calls"
    else:
        for kind, text in plan(gen.model, body):
            if gen.completion_tokens >= gen.max_tokens and gen.model != "chatty":
                finish = "length"
                break
            await _pause(delay)
            gen.count(text)
            choice: dict[str, Any] = (
                {"index": 0, "text": text, "finish_reason": None} if legacy
                else {"index": 0, "delta": {kind: text}, "finish_reason": None}
            )
            await response.write(gen.chunk(choice))
            if (
                gen.model in MID_STREAM_TROUBLE
                and gen.completion_tokens >= TOKENS_BEFORE_TROUBLE
                and await misbehave_mid_stream(request, gen.model, f"id={gen.id}")
            ):
                return response
    options = body.get("stream_options")
    with_usage = isinstance(options, dict) and bool(options.get("include_usage"))
    if legacy:
        # llama-server ends a text completion stream with one chunk: finish_reason, usage and
        # timings, include_usage or not.
        last = {"index": 0, "text": "", "finish_reason": finish}
        await response.write(gen.chunk(last, usage=gen.usage(), timings=gen.timings()))
    else:
        # timings go on the stream's last chunk: the usage chunk when there is one.
        last = {"index": 0, "delta": {}, "finish_reason": finish}
        await response.write(gen.chunk(last, **({} if with_usage else {"timings": gen.timings()})))
        if with_usage:
            await response.write(gen.chunk({}, usage=gen.usage(), timings=gen.timings()))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


# What the `shell` model asks to run: its output (hal0d-42) is not in the command's text, so an
# answer that quotes it proves the command ran; it also leaves a file behind, in the agent's
# working directory.
SHELL_COMMAND = "echo hal0d-$((6*7)) | tee hal0d-shell.txt"
SHELL_OUTPUT = "hal0d-42"
SHELL_ANSWER = "The command printed: "


def shell_result(body: dict[str, Any]) -> str | None:
    """The tool result the conversation ends with, if it does."""
    messages = body.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[-1], dict):
        last = messages[-1]
        if last.get("role") == "tool":
            return message_text(last.get("content")).strip()
    return None


def shell_call(body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The shell tool the request offers, and the arguments that run SHELL_COMMAND with it."""
    names = [tool["function"]["name"] for tool in body.get("tools") or ()
             if isinstance(tool, dict) and isinstance(tool.get("function"), dict)
             and isinstance(tool["function"].get("name"), str)]
    argv = ["bash", "-lc", SHELL_COMMAND]
    for name, arguments in (("exec_command", {"cmd": SHELL_COMMAND}),
                            ("shell_command", {"command": SHELL_COMMAND}),
                            ("shell", {"command": argv}), ("local_shell", {"command": argv})):
        if name in names:
            return name, arguments
    return (names[0] if names else "exec_command"), {"cmd": SHELL_COMMAND}


def first_tool_name(body: dict[str, Any]) -> str:
    tools = body.get("tools")
    if isinstance(tools, list) and tools and isinstance(tools[0], dict):
        function = tools[0].get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return function["name"]
    return "lookup"


def fragments(arguments: bytes, size: int = 16) -> list[str]:
    text = arguments.decode()
    return [text[start:start + size] for start in range(0, len(text), size)]


async def stream_tool_call(response: web.StreamResponse, gen: Generation, delay: float,
                           name: str | None = None,
                           pieces: Iterable[str] = ('{"query"', ': "weather', ' in Paris"}'),
                           ) -> None:
    name = name or first_tool_name(gen.body)
    first = {"index": 0, "id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
             "function": {"name": name, "arguments": ""}}
    await response.write(
        gen.chunk({"index": 0, "delta": {"tool_calls": [first]}, "finish_reason": None})
    )
    for fragment in pieces:
        await _pause(delay)
        gen.count(fragment)
        delta = {"tool_calls": [{"index": 0, "function": {"arguments": fragment}}]}
        await response.write(gen.chunk({"index": 0, "delta": delta, "finish_reason": None}))


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


async def answer_whole(
    request: web.Request,
    model: str,
    body: bytes,
    content_type: str = "application/json",
) -> web.StreamResponse:
    """A non-streamed answer, or the model's misbehaviour in its place: `stall` and `chatty`
    never answer, `broken` sends the headers and half the body, then cuts the connection."""
    log = request.app[LOG_KEY]
    if model in ("stall", "chatty"):
        log.write(f"stalling model={model} (no answer)")
        await asyncio.Event().wait()  # silence until the client goes away
    if model != "broken":
        return web.Response(body=body, content_type=content_type)
    response = web.StreamResponse(headers={hdrs.CONTENT_TYPE: content_type})
    response.content_length = len(body)
    await response.prepare(request)
    await response.write(body[: len(body) // 2])
    log.write(f"breaking model={model} after {len(body) // 2} of {len(body)} bytes")
    assert request.transport is not None
    request.transport.abort()
    return response


def error_body(message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "code": None}}


def bad_request(message: str) -> web.HTTPBadRequest:
    return web.HTTPBadRequest(
        text=orjson.dumps(error_body(message)).decode(), content_type="application/json"
    )


async def read_json(request: web.Request) -> dict[str, Any]:
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        raise bad_request("invalid JSON") from None
    if not isinstance(body, dict):
        raise bad_request("body must be an object")
    return body


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# OpenAI's error types for the statuses aiohttp itself raises.
ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
               413: "invalid_request_error"}


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own errors (unknown path, wrong method, a body over client_max_size) are plain
    text; a client of an OpenAI-compatible server expects them in the OpenAI envelope."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.content_type == "application/json" or exc.status < 400:
            raise
        message = {
            404: f"no endpoint {request.method} {request.path} on the stub",
            405: f"{request.method} is not allowed on {request.path}",
            413: f"request body over {request.client_max_size} bytes",
        }.get(exc.status, exc.reason)
        kind = ERROR_TYPES.get(exc.status, "server_error")
        return web.json_response(error_body(message, kind), status=exc.status)


def logged(endpoint: str) -> Callable[[Handler], Handler]:
    """Wrap a handler with the start / end / cancelled log lines."""

    def wrap(handler: Handler) -> Handler:
        async def run(request: web.Request) -> web.StreamResponse:
            log = request.app[LOG_KEY]
            rid = uuid.uuid4().hex[:8]
            log.write(f"start rid={rid} endpoint={endpoint}")
            try:
                response = await handler(request)
            except asyncio.CancelledError:
                log.write(f"cancelled rid={rid} endpoint={endpoint} (client went away)")
                raise
            except ConnectionResetError:
                log.write(f"cancelled rid={rid} endpoint={endpoint} (connection reset)")
                raise
            except web.HTTPException as exc:
                log.write(f"end rid={rid} endpoint={endpoint} status={exc.status}")
                raise
            log.write(f"end rid={rid} endpoint={endpoint} status={response.status}")
            return response

        return run

    return wrap


async def complete(request: web.Request, model: str, body: dict[str, Any],
                   legacy: bool) -> web.StreamResponse:
    """A chat completion (or, `legacy`, a text completion) on a server slot, held until the
    answer is over or its client gone. With --alias the stub is one model, as llama-server:
    any name asked is served (as "chat" unless it is one of the stub's own), and the answer
    carries the first alias in sorted order."""
    slots = request.app[SLOTS_KEY]
    aliases = request.app[ALIASES_KEY]
    context = request.app[CONTEXT_KEY]
    if aliases and model not in MODELS:
        model = "chat"
    prompt = token_ids(prompt_text(body))
    if (refusal := context.refusal(len(prompt), asked_max_tokens(body))) is not None:
        return refusal  # before any slot is taken: the prompt is never read
    async with slots.turn(prompt, body) as turn:
        gen = Generation(model, body, "text_completion" if legacy else "chat.completion.chunk",
                         turn, aliases[0] if aliases else None, room=context.room(len(prompt)))
        if body.get("stream"):
            return await stream_tokens(request, gen, legacy=legacy)
        await turn.prefill()
        answer = complete_text(gen) if legacy else complete_chat(gen)
        return await answer_whole(request, model, orjson.dumps(answer))


@logged("chat")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    model = str(body.get("model", ""))
    if model not in MODELS and not request.app[ALIASES_KEY]:
        return web.json_response(
            error_body(f"model {model!r} not found", "not_found_error"), status=404
        )
    return await complete(request, model, body, legacy=False)


@logged("completions")
async def completions(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    return await complete(request, str(body.get("model", "chat")), body, legacy=True)


@logged("speech")
async def speech(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    model = str(body.get("model", ""))
    response = web.StreamResponse(headers={hdrs.CONTENT_TYPE: "audio/wav"})
    await response.prepare(request)
    frames = itertools.count() if model == "chatty" else range(8)
    for index in frames:
        await _pause(request.app[DELAY_KEY])
        await response.write(bytes([index % 256]) * 1024)
        if (
            model in MID_STREAM_TROUBLE
            and index + 1 >= TOKENS_BEFORE_TROUBLE
            and await misbehave_mid_stream(request, model, f"frame={index}")
        ):
            return response
    await response.write_eof()
    return response


def unit_vector(text: str, size: int = 8) -> list[float]:
    """The same text always gets the same embedding (sha256, not the salted built-in hash)."""
    digest = hashlib.sha256(text.encode()).digest()
    return [round(byte / 255, 4) for byte in digest[:size]]


@logged("embeddings")
async def embeddings(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    inputs = body.get("input")
    items = inputs if isinstance(inputs, list) else [inputs]
    data = [
        {"object": "embedding", "index": i, "embedding": unit_vector(str(item))}
        for i, item in enumerate(items)
    ]
    answer = {
        "object": "list", "data": data, "model": body.get("model"),
        "usage": {"prompt_tokens": len(items), "total_tokens": len(items)},
    }
    return await answer_whole(request, str(body.get("model", "")), orjson.dumps(answer))


def tiny_png(width: int = 8, height: int = 8) -> bytes:
    """A real PNG, a grey gradient: small, the same every time, and decodable by any viewer."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data)))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit greyscale
    rows = b"".join(
        b"\x00" + bytes((x + y) * 255 // (width + height - 2) for x in range(width))
        for y in range(height)
    )
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


PNG_B64 = base64.b64encode(tiny_png()).decode("ascii")
MAX_IMAGES = 10


@logged("images")
async def images(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise bad_request("'prompt' is required and must be a non-empty string")
    n = body.get("n", 1)
    if type(n) is not int or not 1 <= n <= MAX_IMAGES:
        raise bad_request(f"'n' must be an integer from 1 to {MAX_IMAGES}")
    if body.get("response_format", "b64_json") == "url":
        # The stub hosts no files: a data URL is a URL every client can open.
        image: dict[str, str] = {"url": f"data:image/png;base64,{PNG_B64}"}
    else:
        image = {"b64_json": PNG_B64}
    answer = {"created": int(time.time()), "data": [dict(image, revised_prompt=prompt)] * n}
    return await answer_whole(request, str(body.get("model", "")), orjson.dumps(answer))


def relevance(query: str, document: str) -> float:
    """The share of the query's words the document holds: deterministic, and it ranks."""
    asked = set(query.lower().split())
    held = set(document.lower().split())
    return round(len(asked & held) / len(asked), 4) if asked else 0.0


def document_text(document: Any) -> str | None:
    if isinstance(document, str):
        return document
    if isinstance(document, dict) and isinstance(document.get("text"), str):
        return str(document["text"])
    return None


@logged("rerank")
async def rerank(request: web.Request) -> web.StreamResponse:
    """llama-server's /v1/rerank, which Jina and Cohere clients also read: results ordered by
    relevance_score, the best first, `top_n` of them; `return_documents` adds each text."""
    body = await read_json(request)
    query, documents = body.get("query"), body.get("documents")
    if not isinstance(query, str) or not query:
        raise bad_request("'query' is required and must be a non-empty string")
    texts = [document_text(d) for d in documents] if isinstance(documents, list) else []
    if not texts or any(text is None for text in texts):
        raise bad_request("'documents' must be a non-empty array of strings or {text} objects")
    top_n = body.get("top_n", len(texts))
    if type(top_n) is not int or top_n < 1:
        raise bad_request("'top_n' must be a positive integer")
    scored = sorted(
        ((index, relevance(query, str(text))) for index, text in enumerate(texts)),
        key=lambda item: (-item[1], item[0]),
    )[:top_n]
    results: list[dict[str, Any]] = []
    for index, score in scored:
        result: dict[str, Any] = {"index": index, "relevance_score": score}
        if body.get("return_documents"):
            result["document"] = {"text": texts[index]}
        results.append(result)
    tokens = len(query.split()) + sum(len(str(text).split()) for text in texts)
    answer = {
        "id": f"rerank-{uuid.uuid4().hex[:24]}", "object": "list",
        "model": body.get("model"), "results": results,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    return await answer_whole(request, str(body.get("model", "")), orjson.dumps(answer))


@logged("transcriptions")
async def transcriptions(request: web.Request) -> web.StreamResponse:
    """OpenAI's multipart upload: the `file`, `model` and `response_format` (json or text)."""
    try:
        form = await request.post()
    except ValueError:
        raise bad_request("body must be multipart/form-data") from None
    upload = form.get("file")
    if not isinstance(upload, web.FileField):
        raise bad_request("multipart field 'file' (the audio) is required")
    audio = upload.file.read()
    model = str(form.get("model", ""))
    text = f"{TRANSCRIPT_TEXT} ({len(audio)} bytes of {upload.content_type})"
    response_format = str(form.get("response_format", "json"))
    if response_format == "text":
        return await answer_whole(request, model, text.encode(), "text/plain")
    if response_format != "json":
        raise bad_request(f"response_format {response_format!r}: the stub serves json or text")
    return await answer_whole(request, model, orjson.dumps({"text": text}))


# The OpenAI Responses API (POST /v1/responses), as vLLM and llama-server serve it: named SSE
# events (`event: response.output_text.delta` ...), each with its `type` and `sequence_number`.
# Answers are kept (a bounded few) for GET and DELETE /v1/responses/{id}.
STORED_RESPONSES = 1000
RESPONSES_KEY = web.AppKey("stub_responses", dict)


def responses_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """A Responses `input` as chat messages, so plan() and prompt_tokens() read it."""
    given = body.get("input")
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    if isinstance(given, list):
        return [item for item in given if isinstance(item, dict)]
    return []


class ResponseGeneration:
    """One Responses answer: the response object as it stands, and the events of its stream."""

    def __init__(self, model: str, body: dict[str, Any], room: int = DEFAULT_MAX_TOKENS
                 ) -> None:
        self.model = model
        self.chat_body = {"messages": responses_messages(body)}
        self.id = f"resp_{uuid.uuid4().hex[:24]}"
        self.item_id = f"msg_{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        limit = asked_max_tokens(body, "max_output_tokens") or DEFAULT_MAX_TOKENS
        self.max_tokens = min(limit, room)  # never past the context's end
        self.sequence = 0
        self.text = ""
        self.output_tokens = 0

    def tokens(self) -> Iterator[str]:
        """The content tokens (the Responses stub answers text only); the limit ends them."""
        for kind, text in plan(self.model, self.chat_body):
            if kind != "content":
                continue
            if self.output_tokens >= self.max_tokens and self.model != "chatty":
                return
            self.output_tokens += 1
            yield text

    def message(self, status: str) -> dict[str, Any]:
        return {"id": self.item_id, "type": "message", "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": self.text, "annotations": []}]}

    def response(self, status: str) -> dict[str, Any]:
        done = status != "in_progress"
        input_tokens = prompt_tokens(self.chat_body)
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.model, "output": [self.message("completed")] if done else [],
            "error": None, "incomplete_details": None, "instructions": None, "metadata": {},
            "parallel_tool_calls": True, "temperature": 1.0, "top_p": 1.0, "tool_choice": "auto",
            "tools": [], "text": {"format": {"type": "text"}},
            "usage": {
                "input_tokens": input_tokens, "output_tokens": self.output_tokens,
                "total_tokens": input_tokens + self.output_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 0},
            } if done else None,
        }

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: ".encode() + orjson.dumps(payload) + b"\n\n"


def store_response(request: web.Request, response: dict[str, Any]) -> None:
    stored = request.app[RESPONSES_KEY]
    stored[response["id"]] = response
    while len(stored) > STORED_RESPONSES:
        del stored[next(iter(stored))]


async def stream_response(request: web.Request, gen: ResponseGeneration) -> web.StreamResponse:
    delay = request.app[DELAY_KEY]
    response = sse_response()
    await response.prepare(request)
    where = {"item_id": gen.item_id, "output_index": 0, "content_index": 0}
    opening = [
        gen.event("response.created", response=gen.response("in_progress")),
        gen.event("response.in_progress", response=gen.response("in_progress")),
        gen.event("response.output_item.added", output_index=0, item={
            "id": gen.item_id, "type": "message", "status": "in_progress", "role": "assistant",
            "content": []}),
        gen.event("response.content_part.added", item_id=gen.item_id, output_index=0,
                  content_index=0, part={"type": "output_text", "text": "", "annotations": []}),
    ]
    await response.write(b"".join(opening))
    for text in gen.tokens():
        await _pause(delay)
        gen.text += text
        await response.write(
            gen.event("response.output_text.delta", **where, delta=text, logprobs=[])
        )
        if (
            gen.model in MID_STREAM_TROUBLE
            and gen.output_tokens >= TOKENS_BEFORE_TROUBLE
            and await misbehave_mid_stream(request, gen.model, f"id={gen.id}")
        ):
            return response
    final = gen.response("completed")
    store_response(request, final)
    closing = [
        gen.event("response.output_text.done", **where, text=gen.text, logprobs=[]),
        gen.event("response.content_part.done", **where,
                  part={"type": "output_text", "text": gen.text, "annotations": []}),
        gen.event("response.output_item.done", output_index=0, item=gen.message("completed")),
        gen.event("response.completed", response=final),
    ]
    await response.write(b"".join(closing))
    await response.write_eof()
    return response


@logged("responses")
async def responses(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    if "input" not in body:
        # The body is checked before the model, as real servers validate it: an empty request
        # is a 400 (which is how hal0d's `responses = "auto"` tells the endpoint is there).
        raise bad_request("'input' is required")
    model = str(body.get("model", ""))
    if model not in MODELS:
        return web.json_response(
            error_body(f"model {model!r} not found", "not_found_error"), status=404
        )
    context = request.app[CONTEXT_KEY]
    prompt = prompt_tokens({"messages": responses_messages(body)})
    refusal = context.refusal(prompt, asked_max_tokens(body, "max_output_tokens"))
    if refusal is not None:
        return refusal
    gen = ResponseGeneration(model, body, context.room(prompt))
    if body.get("stream"):
        return await stream_response(request, gen)
    if model not in ("stall", "chatty", "broken"):
        gen.text = "".join(gen.tokens())
    final = gen.response("completed")
    store_response(request, final)
    return await answer_whole(request, model, orjson.dumps(final))


async def stored_response(request: web.Request) -> web.Response:
    """GET /v1/responses/{id}: a kept answer; DELETE forgets it."""
    response_id = request.match_info["id"]
    stored = request.app[RESPONSES_KEY]
    if response_id not in stored:
        return web.json_response(
            error_body(f"no response {response_id!r}", "not_found_error"), status=404
        )
    if request.method == hdrs.METH_DELETE:
        del stored[response_id]
        return web.json_response({"id": response_id, "object": "response", "deleted": True})
    return web.json_response(stored[response_id])


# The Anthropic Messages API served natively (llama-server and vLLM do), when the stub is made
# with `anthropic_native`: the same tokens as chat completions, in Anthropic's events. The
# request's anthropic-version and anthropic-beta headers go into the log, for the tests to read.


def anthropic_tool_name(body: dict[str, Any]) -> str:
    tools = body.get("tools")
    if isinstance(tools, list) and tools and isinstance(tools[0], dict):
        name = tools[0].get("name")
        if isinstance(name, str):
            return name
    return "lookup"


def anthropic_event(kind: str, **fields: Any) -> bytes:
    return f"event: {kind}\ndata: ".encode() + orjson.dumps({"type": kind, **fields}) + b"\n\n"


def anthropic_blocks(model: str, body: dict[str, Any], limit: int) -> Iterator[tuple[str, str]]:
    """(block type, piece) for each generated token, up to `limit` (chatty: no limit)."""
    if model == "tool":
        for fragment in ('{"query"', ': "weather', ' in Paris"}'):
            yield "tool_use", fragment
        return
    for count, (kind, text) in enumerate(plan(model, body)):
        if count >= limit and model != "chatty":
            return
        yield ("thinking" if kind == "reasoning_content" else "text"), text


def empty_block(kind: str, body: dict[str, Any]) -> dict[str, Any]:
    if kind == "tool_use":
        return {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:20]}",
                "name": anthropic_tool_name(body), "input": {}}
    if kind == "thinking":
        return {"type": "thinking", "thinking": "", "signature": ""}
    return {"type": "text", "text": ""}


DELTA_FIELDS = {"text": ("text_delta", "text"), "thinking": ("thinking_delta", "thinking"),
                "tool_use": ("input_json_delta", "partial_json")}


@logged("messages")
async def native_messages(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    log = request.app[LOG_KEY]
    log.write(f"native-messages anthropic-version={request.headers.get('anthropic-version')} "
              f"anthropic-beta={request.headers.get('anthropic-beta')}")
    if not isinstance(body.get("messages"), list):
        # The body is checked before the model, as real servers validate it (a request without
        # messages is a 400 there, whatever its model).
        return web.json_response({"type": "error", "error": {
            "type": "invalid_request_error", "message": "messages: field required"}}, status=400)
    model = str(body.get("model", ""))
    if model not in MODELS:
        return web.json_response({"type": "error", "error": {
            "type": "not_found_error", "message": f"model {model!r} not found"}}, status=404)
    context, prompt = request.app[CONTEXT_KEY], prompt_tokens(body)
    asked = asked_max_tokens(body, "max_tokens")
    if (refusal := context.refusal(prompt, asked, anthropic=True)) is not None:
        return refusal
    limit = min(asked or DEFAULT_MAX_TOKENS, context.room(prompt))
    message: dict[str, Any] = {
        "id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant",
        "model": model, "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": prompt, "output_tokens": 0},
    }
    pieces = anthropic_blocks(model, body, limit)
    if not body.get("stream"):
        if model in ("stall", "chatty"):
            return await answer_whole(request, model, b"")
        return await answer_whole(request, model, orjson.dumps(
            native_whole(message, pieces, body, limit)))
    return await native_stream(request, message, pieces, body, limit)


def stop_reason(model: str, output: int, limit: int) -> str:
    return "tool_use" if model == "tool" else ("max_tokens" if output >= limit else "end_turn")


def native_whole(message: dict[str, Any], pieces: Iterable[tuple[str, str]],
                 body: dict[str, Any], limit: int) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    output = 0
    for kind, piece in pieces:
        output += 1
        if not content or content[-1]["type"] != kind:
            content.append(empty_block(kind, body))
        block = content[-1]
        if kind == "tool_use":
            block["_json"] = block.get("_json", "") + piece
        else:
            block[kind] += piece
    for block in content:
        if "_json" in block:
            block["input"] = orjson.loads(block.pop("_json"))
    message["usage"]["output_tokens"] = output
    return {**message, "content": content,
            "stop_reason": stop_reason(message["model"], output, limit)}


async def native_stream(request: web.Request, message: dict[str, Any],
                        pieces: Iterable[tuple[str, str]], body: dict[str, Any],
                        limit: int) -> web.StreamResponse:
    model = message["model"]
    response = sse_response()
    await response.prepare(request)
    await response.write(anthropic_event("message_start", message=message))
    index, open_kind, output = -1, None, 0
    for kind, piece in pieces:
        if kind != open_kind:
            if open_kind is not None:
                await response.write(anthropic_event("content_block_stop", index=index))
            index, open_kind = index + 1, kind
            await response.write(anthropic_event(
                "content_block_start", index=index, content_block=empty_block(kind, body)))
        await _pause(request.app[DELAY_KEY])
        output += 1
        delta_type, field_name = DELTA_FIELDS[kind]
        await response.write(anthropic_event(
            "content_block_delta", index=index, delta={"type": delta_type, field_name: piece}))
        if (
            model in MID_STREAM_TROUBLE
            and output >= TOKENS_BEFORE_TROUBLE
            and await misbehave_mid_stream(request, model, f"id={message['id']}")
        ):
            return response
    if open_kind is not None:
        await response.write(anthropic_event("content_block_stop", index=index))
    await response.write(anthropic_event(
        "message_delta", delta={"stop_reason": stop_reason(model, output, limit),
                                "stop_sequence": None},
        usage={"input_tokens": message["usage"]["input_tokens"], "output_tokens": output}))
    await response.write(anthropic_event("message_stop"))
    await response.write_eof()
    return response


async def native_count_tokens(request: web.Request) -> web.Response:
    body = await read_json(request)
    request.app[LOG_KEY].write("native-count-tokens")
    return web.json_response({"input_tokens": prompt_tokens(body)})


async def tokenize(request: web.Request) -> web.Response:
    """llama-server's shape: {"content": text, "add_special": false} -> {"tokens": [...]}; like
    llama-server's, it adds no BOS unless asked (its completion does add one)."""
    body = await read_json(request)
    content = body.get("content")
    if not isinstance(content, str):
        return web.json_response(error_body("content is required"), status=400)
    add_special = body.get("add_special", False) is True
    request.app[LOG_KEY].write("tokenize")
    return web.json_response(
        {"tokens": list(range(count_tokens(content, add_special=add_special)))}
    )


async def template(request: web.Request) -> web.Response:
    """llama-server's POST /apply-template: a chat request -> {"prompt": the templated text}."""
    body = await read_json(request)
    if not isinstance(body.get("messages"), list):
        return web.json_response(error_body("messages: an array is required"), status=400)
    request.app[LOG_KEY].write("apply-template")
    return web.json_response({"prompt": apply_template(body)})


async def models(request: web.Request) -> web.Response:
    """The stub's models; playing vLLM, each with its max_model_len, as vLLM lists them."""
    limit = request.app[CONTEXT_KEY].max_model_len
    told = {} if limit is None else {"max_model_len": limit}
    return web.json_response(
        {"object": "list",
         "data": [{"id": m, "object": "model", "owned_by": "hal0d-stub", **told}
                  for m in MODELS]}
    )


def make_stub_app(
    log_path: Path | None = None, delay: float = 0.02, *, anthropic_native: bool = False,
    chat_only: bool = False, slot_options: SlotOptions | None = None,
    props: dict[str, Any] | None = None, aliases: tuple[str, ...] = (),
    max_model_len: int | None = None,
) -> web.Application:
    """`anthropic_native`: also serve /v1/messages (and count_tokens) as llama-server does;
    without it those paths answer 404, like llama-cpp-python's server. `chat_only`: no
    /v1/responses (a 404), as llama-cpp-python's server and older vLLM. `slot_options`: the
    server slots' (one slot, no --slot-save-path, an instant prefill by default; without them,
    the context `props` names, else 4096). `props`: what GET /props answers, as llama-server
    describes itself (without it a 404, as vLLM), its n_ctx the slots' own. `aliases`:
    llama-server's --alias names (see `complete`). `max_model_len`: the stub plays vLLM's
    context check instead of llama-server's (context.py)."""
    app = web.Application(middlewares=[json_errors], client_max_size=MAX_BODY_BYTES)
    app[ALIASES_KEY] = tuple(sorted(aliases))
    app[LOG_KEY] = StubLog(log_path)
    app[DELAY_KEY] = delay
    app[RESPONSES_KEY] = {}
    slot_options = slot_options or SlotOptions(ctx_size=ctx_size(None, props, 1))
    n_ctx = slot_options.ctx_size // slot_options.parallel
    app[CONTEXT_KEY] = ContextLimit(n_ctx, max_model_len)
    app[SLOTS_KEY] = ServerSlots(slot_options, app[LOG_KEY].write)
    slot_api = SlotApi(app[SLOTS_KEY], app[LOG_KEY].write)
    app.router.add_get("/slots", slot_api.list_slots)
    app.router.add_post("/slots/{id_slot}", slot_api.act)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/audio/speech", speech)
    app.router.add_post("/v1/audio/transcriptions", transcriptions)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/v1/images/generations", images)
    app.router.add_post("/v1/rerank", rerank)
    if not chat_only:
        app.router.add_post("/v1/responses", responses)
        app.router.add_get("/v1/responses/{id}", stored_response)
        app.router.add_delete("/v1/responses/{id}", stored_response)
    if anthropic_native:
        app.router.add_post("/v1/messages", native_messages)
        app.router.add_post("/v1/messages/count_tokens", native_count_tokens)
    if props is not None:
        described = with_n_ctx(props, n_ctx)

        async def self_description(request: web.Request) -> web.Response:
            app[LOG_KEY].write("props")
            return web.json_response(described)

        app.router.add_get("/props", self_description)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/apply-template", template)

    async def close_log(app: web.Application) -> None:
        app[LOG_KEY].close()

    app.on_cleanup.append(close_log)
    return app


def run_stub(
    host: str,
    port: int,
    log_path: Path | None,
    delay: float,
    *,
    startup_delay: float = 0.0,
    fail_start: str | None = None,
    anthropic_native: bool = False,
    chat_only: bool = False,
    slot_options: SlotOptions | None = None,
    props: dict[str, Any] | None = None,
    aliases: tuple[str, ...] = (),
    device_load: DeviceLoad | None = None,
    max_model_len: int | None = None,
) -> int:
    """Serve until stopped. `startup_delay`: seconds before listening, as a model server loads its
    weights first. `fail_start`: after the delay, print this line and exit 1 instead of serving,
    as a model server does when its model file is missing or does not fit. `anthropic_native`:
    also serve the Anthropic Messages API, as llama-server does; `chat_only`: serve no
    Responses API, as llama-cpp-python's server. `slot_options`: its server slots'; a
    --slot-save-path that is not a directory is refused at once, as llama-server refuses it.
    `props`: what GET /props answers (--props); `aliases`: llama-server's --alias names.
    `device_load`: its footprint on the simulated GPU box, taken as it loads (device_load.py);
    when it does not fit, llama-server's out-of-memory lines and exit 1. `max_model_len`:
    vLLM's context check in place of llama-server's (--max-model-len)."""
    save_path = slot_options.save_path if slot_options else None
    if save_path is not None and not save_path.is_dir():
        print(f"stub: --slot-save-path: not a directory: {save_path}", file=sys.stderr,
              flush=True)
        return 1
    if device_load is not None and not claim(device_load):
        return 1
    if startup_delay > 0:
        print(f"stub: loading for {startup_delay:g} s", flush=True)
        time.sleep(startup_delay)
    if fail_start is not None:
        print(fail_start, file=sys.stderr, flush=True)
        return 1
    web.run_app(
        make_stub_app(log_path, delay, anthropic_native=anthropic_native, chat_only=chat_only,
                      slot_options=slot_options, props=props, aliases=aliases,
                      max_model_len=max_model_len),
        host=host,
        port=port,
        handler_cancellation=True,
        access_log=None,
        print=None,
    )
    return 0
