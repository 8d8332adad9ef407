"""The stub's models: the names it answers to (GET /v1/models lists them), and the tokens each
one generates (`plan`), which every surface streams or joins in its own shape.

The name picks the behaviour (app.py's docstring has the list): reasoning then content, content
alone, a tool call, an agent's shell turn, or a misbehaviour, whose tokens come from here too.
The tests compare what they receive to these texts (CONTENT_TEXT, REASONING_TEXT, SHELL_OUTPUT).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from aiohttp import web

from hal0d_stub.appkeys import CONTEXT_KEY
from hal0d_stub.prompt import message_text

MODELS = ("reasoning", "chat", "think-only", "tool", "stall", "chatty", "broken", "shell")
REASONING_TEXT = "The user greets me. A short friendly answer fits best here."
CONTENT_TEXT = "Hello! I am the hal0d stub upstream. How can I help you today?"
LONG_WORDS = ["and", "the", "model", "keeps", "talking", "about", "nothing", "in", "particular"]
DEFAULT_MAX_TOKENS = 256


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


async def models(request: web.Request) -> web.Response:
    """The stub's models; playing vLLM, each with its max_model_len, as vLLM lists them."""
    limit = request.app[CONTEXT_KEY].max_model_len
    told = {} if limit is None else {"max_model_len": limit}
    return web.json_response(
        {"object": "list",
         "data": [{"id": m, "object": "model", "owned_by": "hal0d-stub", **told}
                  for m in MODELS]}
    )
