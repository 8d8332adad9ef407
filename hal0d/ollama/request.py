"""Ollama requests in, OpenAI request bodies out (pure): /api/chat and /api/generate become a
chat completion, /api/embed and /api/embeddings an embeddings request.

What maps where:

    messages[].content, .images        content, image_url parts (data: URLs, type sniffed)
    messages[].tool_calls (objects)    tool_calls with arguments as a JSON string, ids made up
                                       where the client sent none; a tool message gets the id
                                       of the call it answers (by tool_call_id, else in order)
    messages[].thinking                dropped (the model's own earlier reasoning)
    generate: prompt, system, images   a system and a user message
    tools                              tools (Ollama's are OpenAI's function tools already)
    format "json" | a JSON schema      response_format json_object | json_schema
    options                            see OPTIONS; the load-time ones (num_ctx, num_gpu...) are
                                       the slot command's to decide, and any other is unknown:
                                       both are ignored, and named in `ignored`
    think true | "low".."max" | absent reasoning deltas become `thinking` (absent: as Ollama does
                                       for a model that thinks); false drops them, unless the
                                       model said nothing else (then they are the content)
    keep_alive 5m | 300 | -1 | 0       seconds, negative for ever (Duration in Ollama's API)
    stream (default true)              stream, with stream_options.include_usage

Pure like the other surfaces' translations: no asyncio, no aiohttp (tests/test_purity.py).
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field
from typing import Any, NoReturn

import orjson

from hal0d.config import go_duration
from hal0d.errors import InvalidRequest
from hal0d.protocol.limits import MAX_MESSAGES

# Ollama option -> the chat completion field it becomes. The OpenAI names where OpenAI has one;
# llama-server's (and vLLM's, where they agree) for the rest.
OPTIONS: dict[str, str] = {
    "num_predict": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "typical_p": "typical_p",
    "seed": "seed",
    "stop": "stop",
    "repeat_penalty": "repeat_penalty",
    "repeat_last_n": "repeat_last_n",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "num_keep": "n_keep",
}
# Set when a model is loaded, in Ollama: a slot's command decides these in hal0d.
LOAD_OPTIONS = frozenset({"num_ctx", "num_batch", "num_gpu", "main_gpu", "use_mmap",
                          "num_thread", "numa", "low_vram", "vocab_only", "use_mlock",
                          "draft_num_predict"})
THINK_LEVELS = ("high", "medium", "low", "max")
KEEP_FOR_EVER = -1.0

# The first bytes of the image formats vision models take; anything else is sent as PNG.
_IMAGE_MAGIC = ((b"\x89PNG", "image/png"), (b"\xff\xd8\xff", "image/jpeg"),
                (b"GIF8", "image/gif"), (b"RIFF", "image/webp"))


@dataclass(slots=True)
class OllamaRequest:
    """One /api/chat or /api/generate request, checked; `payload(model)` is its upstream body."""

    model: str
    stream: bool
    think: bool | None  # None: the request did not say
    messages: list[dict[str, Any]]
    keep_alive_s: float | None = None
    options: dict[str, Any] = field(default_factory=dict)
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None
    ignored: tuple[tuple[str, Any], ...] = ()  # the options hal0d does not pass on, as sent

    @property
    def load_only(self) -> bool:
        """No prompt at all: Ollama loads (or, with keep_alive 0, unloads) and answers done."""
        return not self.messages

    def payload(self, served_model: str) -> dict[str, Any]:
        out: dict[str, Any] = {"model": served_model, "messages": self.messages, **self.options}
        if self.tools:
            out["tools"] = self.tools
        if self.response_format is not None:
            out["response_format"] = self.response_format
        if self.stream:
            out["stream"] = True
            out["stream_options"] = {"include_usage": True}
        return out


@dataclass(frozen=True, slots=True)
class EmbedRequest:
    model: str
    inputs: list[str]
    keep_alive_s: float | None
    dimensions: int | None
    legacy: bool  # /api/embeddings: one prompt, one `embedding`

    def payload(self, served_model: str) -> dict[str, Any]:
        out: dict[str, Any] = {"model": served_model, "input": self.inputs}
        if self.dimensions is not None:
            out["dimensions"] = self.dimensions
        return out


def _invalid(problem: str, name: str | None = None) -> NoReturn:
    raise InvalidRequest(problem, field=name)


def _model(body: dict[str, Any]) -> str:
    model = body.get("model") or body.get("name")  # `name`: the API's older spelling
    if not isinstance(model, str) or not model:
        _invalid("model is required", "model")
    return model


def parse_chat(body: dict[str, Any]) -> OllamaRequest:
    messages = body.get("messages")
    if messages is None:
        messages = []
    if not isinstance(messages, list):
        _invalid("messages must be an array", "messages")
    if len(messages) > MAX_MESSAGES:
        _invalid(f"messages holds more than {MAX_MESSAGES} items", "messages")
    return _common(body, to_openai_messages(messages))


def parse_generate(body: dict[str, Any]) -> OllamaRequest:
    prompt = body.get("prompt") or ""
    system = body.get("system") or ""
    if not isinstance(prompt, str) or not isinstance(system, str):
        _invalid("prompt and system must be strings", "prompt")
    messages: list[dict[str, Any]] = []
    if prompt or body.get("images"):
        if system:
            messages.append({"role": "system", "content": system})
        messages.append({"role": "user", "content": _content(prompt, body.get("images"),
                                                             "images")})
    return _common(body, messages)


def _common(body: dict[str, Any], messages: list[dict[str, Any]]) -> OllamaRequest:
    stream = body.get("stream", True)
    if stream is None:
        stream = True
    if not isinstance(stream, bool):
        _invalid("stream must be a boolean", "stream")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        _invalid("tools must be an array", "tools")
    options, ignored = map_options(body.get("options"))
    return OllamaRequest(
        model=_model(body), stream=stream, think=parse_think(body.get("think")),
        messages=messages, keep_alive_s=parse_keep_alive(body.get("keep_alive")),
        options=options, tools=tools or None,
        response_format=parse_format(body.get("format")), ignored=ignored,
    )


def parse_think(value: object) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    if value in THINK_LEVELS:
        return True
    _invalid(f"invalid think value: {value!r} (must be \"high\", \"medium\", \"low\", \"max\", "
             "true, or false)", "think")


def parse_keep_alive(value: object) -> float | None:
    """Seconds; KEEP_FOR_EVER (negative) for ever; None when the client did not say."""
    if value is None:
        return None
    if isinstance(value, bool):
        _invalid("keep_alive must be a duration (\"5m\") or a number of seconds", "keep_alive")
    if isinstance(value, int | float):
        return KEEP_FOR_EVER if value < 0 else float(value)
    if not isinstance(value, str):
        _invalid("keep_alive must be a duration (\"5m\") or a number of seconds", "keep_alive")
    seconds = go_duration(value)
    if seconds is None:
        _invalid(f"time: invalid duration {value!r}", "keep_alive")
    return KEEP_FOR_EVER if seconds < 0 else seconds


def parse_format(value: object) -> dict[str, Any] | None:
    if value is None or value == "":
        return None
    if value == "json":
        return {"type": "json_object"}
    if isinstance(value, dict):
        return {"type": "json_schema", "json_schema": {"name": "response", "schema": value}}
    _invalid(f"invalid format: {value!r} (\"json\" or a JSON schema object)", "format")


def map_options(options: object) -> tuple[dict[str, Any], tuple[tuple[str, Any], ...]]:
    """The options as chat completion fields, and those not passed on (name, value)."""
    if options is None:
        return {}, ()
    if not isinstance(options, dict):
        _invalid("options must be an object", "options")
    out: dict[str, Any] = {}
    ignored: list[tuple[str, Any]] = []
    for name, value in options.items():
        target = OPTIONS.get(name)
        if target is None:
            ignored.append((name, value))
            continue
        if value is None:
            continue
        if name == "stop":
            if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
                _invalid("option \"stop\" must be an array of strings", "options.stop")
        elif isinstance(value, bool) or not isinstance(value, int | float):
            _invalid(f"option {name!r} must be a number", f"options.{name}")
        if name == "num_predict":
            if value < 0:
                continue  # -1 (no limit) and -2 (fill the context): the upstream's own limit
            out[target] = max(1, int(value))
        elif name in ("seed", "top_k", "repeat_last_n", "num_keep"):
            out[target] = int(value)
        else:
            out[target] = value
    return out, tuple(ignored)


def to_openai_messages(messages: list[Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    unanswered: list[tuple[str, str]] = []  # (id, name) of the tool calls not yet answered
    for index, message in enumerate(messages):
        where = f"messages.{index}"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            _invalid(f"{where}: each message must be an object with a string role", where)
        role = message["role"].lower()
        content = message.get("content") or ""
        if not isinstance(content, str):
            _invalid(f"{where}.content must be a string", f"{where}.content")
        if role == "assistant" and message.get("tool_calls"):
            calls = _tool_calls(message["tool_calls"], index, where)
            unanswered += [(call["id"], call["function"]["name"]) for call in calls]
            out.append({"role": "assistant", "content": content or None, "tool_calls": calls})
        elif role == "tool":
            out.append({"role": "tool", "content": content,
                        "tool_call_id": _answered(message, unanswered)})
        else:
            out.append({"role": role,
                        "content": _content(content, message.get("images"), f"{where}.images")})
    return out


def _tool_calls(calls: object, index: int, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        _invalid(f"{where}.tool_calls must be an array", f"{where}.tool_calls")
    out = []
    for number, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            _invalid(f"{where}.tool_calls.{number}.function needs a name",
                     f"{where}.tool_calls.{number}")
        arguments = function.get("arguments") or {}
        # Some clients send the OpenAI form, a JSON string.
        encoded = arguments if isinstance(arguments, str) else orjson.dumps(arguments).decode()
        call_id = call.get("id") or f"call_{index}_{number}"
        out.append({"id": call_id, "type": "function",
                    "function": {"name": function["name"], "arguments": encoded}})
    return out


def _answered(message: dict[str, Any], unanswered: list[tuple[str, str]]) -> str:
    """The id of the tool call a tool message answers: its own tool_call_id, else the first
    unanswered call of its tool_name, else the first unanswered call."""
    given = message.get("tool_call_id")
    if isinstance(given, str) and given:
        unanswered[:] = [call for call in unanswered if call[0] != given]
        return given
    name = message.get("tool_name") or message.get("name")
    for position, (call_id, call_name) in enumerate(unanswered):
        if name is None or call_name == name:
            del unanswered[position]
            return call_id
    return f"call_{name or 'unknown'}"


def _content(text: str, images: object, where: str) -> str | list[dict[str, Any]]:
    if not images:
        return text
    if not isinstance(images, list) or not all(isinstance(i, str) and i for i in images):
        _invalid(f"{where} must be an array of base64 strings", where)
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    for image in images:
        parts.append({"type": "image_url",
                      "image_url": {"url": f"data:{image_type(image)};base64,{image}"}})
    return parts


def image_type(data: str) -> str:
    """The media type of a base64 image from its first bytes (PNG when unknown)."""
    try:
        head = base64.b64decode(data[:16] + "=" * (-len(data[:16]) % 4), validate=False)
    except (binascii.Error, ValueError):
        return "image/png"
    for magic, media_type in _IMAGE_MAGIC:
        if head.startswith(magic):
            return media_type
    return "image/png"


def parse_embed(body: dict[str, Any], *, legacy: bool) -> EmbedRequest:
    """/api/embed (`input`: a string or strings) or, `legacy`, /api/embeddings (`prompt`)."""
    if legacy:
        prompt = body.get("prompt", "")
        if not isinstance(prompt, str):
            _invalid("prompt must be a string", "prompt")
        inputs = [prompt]
    else:
        given = body.get("input", "")
        inputs = [given] if isinstance(given, str) else given
        if not isinstance(inputs, list) or not all(isinstance(i, str) for i in inputs):
            _invalid("input must be a string or an array of strings", "input")
    dimensions = body.get("dimensions")
    if dimensions is not None and (type(dimensions) is not int or dimensions < 1):
        _invalid("dimensions must be a positive integer", "dimensions")
    return EmbedRequest(model=_model(body), inputs=inputs,
                        keep_alive_s=parse_keep_alive(body.get("keep_alive")),
                        dimensions=dimensions or None, legacy=legacy)
