"""The prompt a completion reads, and how many tokens it is: the stub's chat template and its
tokenizer, and llama-server's two endpoints that show them (/tokenize, /apply-template).

usage.prompt_tokens, the context check and those two endpoints all count with this one template
and tokenizer, so a test can compute what the stub will report (prompt_tokens) and hold hal0d's
own count to it.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from hal0d_stub.appkeys import LOG_KEY
from hal0d_stub.handling import error_body, read_json

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
