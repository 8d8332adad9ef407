"""The Anthropic request: a Messages API body in, an OpenAI chat completions body out (pure).

Two steps, so the handler can route before it translates (hal0d/handlers/anthropic.py):

    req = parse_messages_request(body)    # validates; raises InvalidRequest naming the field
    route = router.resolve(req.model)     # by the model name the client sent
    payload = to_openai(
        req, served_model=route.served_model, max_output_tokens=route.slot.max_output_tokens
    )
    # when req.stream: the stream's events are translated back by
    Translator(req.model, input_tokens=input_tokens, stop_sequences=req.stop_sequences)

Validation and the message translation happen in one walk inside `parse_messages_request`; the
result holds OpenAI-shaped messages. Unknown top-level keys (thinking, cache hints, betas) and
unknown keys inside blocks (cache_control, citations) are ignored, because real clients send many
of them; unknown block types are refused, because dropping content silently changes the answer.

Choices made where the two APIs do not line up:
- several text blocks in one message are joined with "\\n" into one string (local chat templates
  expect string content); a message with images becomes an OpenAI content-part list;
- tool_result blocks become role "tool" messages placed before the rest of that user message;
  images inside a tool_result are dropped (OpenAI tool messages carry text only);
- thinking and redacted_thinking blocks in the history are dropped;
- role "system" messages inside `messages` are appended to the leading system prompt;
- an assistant message with tool calls and no text has content None, as OpenAI writes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NoReturn

import orjson

from hal0d.errors import InvalidRequest
from hal0d.protocol.limits import MAX_MESSAGES, MAX_TOKENS_LIMIT

__all__ = ["MessagesRequest", "parse_messages_request", "prompt_text", "to_openai"]


_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


@dataclass(frozen=True, slots=True)
class MessagesRequest:
    model: str
    max_tokens: int
    stream: bool
    messages: list[dict[str, Any]]
    stop_sequences: tuple[str, ...] = ()
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    user: str | None = None


def parse_messages_request(body: Any) -> MessagesRequest:
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        _invalid("model", "is required and must be a non-empty string")
    max_tokens = body.get("max_tokens")
    if type(max_tokens) is not int:
        _invalid("max_tokens", "is required and must be an integer")
    if not 1 <= max_tokens <= MAX_TOKENS_LIMIT:
        _invalid("max_tokens", f"must be between 1 and {MAX_TOKENS_LIMIT}")

    stream = _optional(body, "stream", bool, "a boolean")
    temperature = _optional_number(body, "temperature")
    top_p = _optional_number(body, "top_p")
    top_k = _optional(body, "top_k", int, "an integer")
    stop_sequences = _stop_sequences(body.get("stop_sequences"))

    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list):
        _invalid("messages", "is required and must be a list")
    if not raw_messages:
        _invalid("messages", "must contain at least one message")
    if len(raw_messages) > MAX_MESSAGES:
        _invalid("messages", f"must contain at most {MAX_MESSAGES} messages")

    system = _system_parts(body.get("system"))
    messages: list[dict[str, Any]] = []
    for i, message in enumerate(raw_messages):
        _message(message, f"messages.{i}", system, messages)
    if system:
        messages.insert(0, {"role": "system", "content": "\n".join(system)})

    tools = _tools(body.get("tools"))
    tool_choice, parallel = _tool_choice(body.get("tool_choice"))

    user = None
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict):
            _invalid("metadata", "must be an object")
        user = metadata.get("user_id")
        if user is not None and not isinstance(user, str):
            _invalid("metadata.user_id", "must be a string")

    return MessagesRequest(
        model=model,
        max_tokens=max_tokens,
        stream=bool(stream),
        messages=messages,
        stop_sequences=stop_sequences,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel,
        user=user,
    )


# The request's fields a chat completion names alike, sent on when the client set them.
PASSED_ON = ("temperature", "top_p", "top_k", "tools", "tool_choice", "parallel_tool_calls",
             "user")


def to_openai(
    req: MessagesRequest, *, served_model: str, max_output_tokens: int | None = None
) -> dict[str, Any]:
    """The upstream body. Shares the messages list with `req` rather than copying it."""
    max_tokens = (
        req.max_tokens if max_output_tokens is None else min(req.max_tokens, max_output_tokens)
    )
    out: dict[str, Any] = {
        "model": served_model,
        "messages": req.messages,
        "max_tokens": max_tokens,
    }
    if req.stop_sequences:
        out["stop"] = list(req.stop_sequences)
    for name in PASSED_ON:
        if (value := getattr(req, name)) is not None:
            out[name] = value
    if req.stream:
        out["stream"] = True
        # continuous_usage_stats is vLLM's; servers that do not know it ignore it.
        out["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return out


def prompt_text(openai_request: dict[str, Any]) -> str:
    """Everything the model reads, as one string, for counting tokens when the upstream cannot.

    Tool definitions are included: they are part of the prompt, and agents send large ones.
    """
    parts: list[str] = []
    for message in openai_request.get("messages") or ():
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(p["text"] for p in content if p.get("type") == "text")
        for call in message.get("tool_calls") or ():
            function = call["function"]
            parts.append(function["name"])
            parts.append(function["arguments"])
    for tool in openai_request.get("tools") or ():
        function = tool["function"]
        parts.append(function["name"])
        if function.get("description"):
            parts.append(function["description"])
        parts.append(orjson.dumps(function.get("parameters")).decode())
    return "\n".join(part for part in parts if part)


def _invalid(field: str, problem: str) -> NoReturn:
    raise InvalidRequest(f"{field}: {problem}", field=field)


def _string(obj: dict[str, Any], key: str, path: str) -> str:
    """`obj[key]`, which must be a non-empty string (InvalidRequest naming `path.key`)."""
    value = obj.get(key)
    if not isinstance(value, str) or not value:
        _invalid(f"{path}.{key}", "is required and must be a string")
    return value


def _optional(body: dict[str, Any], key: str, kind: type, described: str) -> Any:
    value = body.get(key)
    # bool is an int subclass; neither may stand in for the other.
    if value is not None and type(value) is not kind:
        _invalid(key, f"must be {described}")
    return value


def _optional_number(body: dict[str, Any], key: str) -> float | None:
    value = body.get(key)
    if value is not None and (type(value) is not int and type(value) is not float):
        _invalid(key, "must be a number")
    return value


def _stop_sequences(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        _invalid("stop_sequences", "must be a list of strings")
    for i, item in enumerate(value):
        if not isinstance(item, str):
            _invalid(f"stop_sequences.{i}", "must be a string")
    return tuple(value)


def _system_parts(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value else []
    if not isinstance(value, list):
        _invalid("system", "must be a string or a list of text blocks")
    return [text for text in _text_blocks(value, "system") if text]


def _text_blocks(blocks: list[Any], path: str) -> list[str]:
    texts = []
    for i, block in enumerate(blocks):
        kind = _block_type(block, f"{path}.{i}")
        if kind != "text":
            _invalid(f"{path}.{i}.type", f"only text blocks are allowed here, not {kind!r}")
        texts.append(_text(block, f"{path}.{i}"))
    return texts


def _block_type(block: Any, path: str) -> str:
    if not isinstance(block, dict):
        _invalid(path, "content block must be an object")
    kind = block.get("type")
    if not isinstance(kind, str):
        _invalid(f"{path}.type", "is required and must be a string")
    return kind


def _text(block: dict[str, Any], path: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        _invalid(f"{path}.text", "is required and must be a string")
    return text


def _message(message: Any, path: str, system: list[str], out: list[dict[str, Any]]) -> None:
    if not isinstance(message, dict):
        _invalid(path, "message must be an object")
    role = message.get("role")
    if role not in ("user", "assistant", "system"):
        _invalid(f"{path}.role", "must be 'user', 'assistant' or 'system'")
    content = message.get("content")
    content_path = f"{path}.content"
    if not isinstance(content, (str, list)):
        _invalid(content_path, "must be a string or a list of content blocks")
    if role == "system":
        if isinstance(content, str):
            if content:
                system.append(content)
        else:
            system.extend(text for text in _text_blocks(content, content_path) if text)
    elif isinstance(content, str):
        out.append({"role": role, "content": content})
    elif role == "user":
        _user_blocks(content, content_path, out)
    else:
        out.append(_assistant_blocks(content, content_path))


def _user_blocks(blocks: list[Any], path: str, out: list[dict[str, Any]]) -> None:
    parts: list[dict[str, Any]] = []
    has_image = False
    for i, block in enumerate(blocks):
        block_path = f"{path}.{i}"
        kind = _block_type(block, block_path)
        if kind == "text":
            parts.append({"type": "text", "text": _text(block, block_path)})
        elif kind == "image":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block, block_path)}})
            has_image = True
        elif kind == "tool_result":
            out.append(_tool_result(block, block_path))
        elif kind in ("thinking", "redacted_thinking"):
            continue
        elif kind == "tool_use":
            _invalid(f"{block_path}.type", "tool_use blocks belong in assistant messages")
        else:
            _invalid(f"{block_path}.type", f"unsupported content block type {kind!r}")
    if has_image:
        out.append({"role": "user", "content": parts})
    elif parts or not blocks:
        out.append({"role": "user", "content": "\n".join(part["text"] for part in parts)})


def _assistant_blocks(blocks: list[Any], path: str) -> dict[str, Any]:
    texts: list[str] = []
    tool_calls: list[dict[str, Any]] = []
    for i, block in enumerate(blocks):
        block_path = f"{path}.{i}"
        kind = _block_type(block, block_path)
        if kind == "text":
            texts.append(_text(block, block_path))
        elif kind == "tool_use":
            tool_calls.append(_tool_use(block, block_path))
        elif kind in ("thinking", "redacted_thinking"):
            continue
        elif kind in ("image", "tool_result"):
            _invalid(f"{block_path}.type", f"{kind} blocks belong in user messages")
        else:
            _invalid(f"{block_path}.type", f"unsupported content block type {kind!r}")
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts else None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    elif message["content"] is None:
        message["content"] = ""
    return message


def _image_url(block: dict[str, Any], path: str) -> str:
    source = block.get("source")
    if not isinstance(source, dict):
        _invalid(f"{path}.source", "is required and must be an object")
    kind = source.get("type")
    if kind == "base64":
        media_type = _string(source, "media_type", f"{path}.source")
        return f"data:{media_type};base64,{_string(source, 'data', f'{path}.source')}"
    if kind == "url":
        return _string(source, "url", f"{path}.source")
    _invalid(f"{path}.source.type", "must be 'base64' or 'url'")


def _tool_use(block: dict[str, Any], path: str) -> dict[str, Any]:
    call_id = _string(block, "id", path)
    name = _string(block, "name", path)
    tool_input = block.get("input")
    if not isinstance(tool_input, dict):
        _invalid(f"{path}.input", "is required and must be an object")
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": orjson.dumps(tool_input).decode()},
    }


def _tool_result(block: dict[str, Any], path: str) -> dict[str, Any]:
    call_id = _string(block, "tool_use_id", path)
    content = block.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for i, inner in enumerate(content):
            inner_path = f"{path}.content.{i}"
            kind = _block_type(inner, inner_path)
            if kind == "text":
                texts.append(_text(inner, inner_path))
            elif kind != "image":
                _invalid(f"{inner_path}.type", f"unsupported tool_result content type {kind!r}")
        text = "\n".join(texts)
    else:
        _invalid(f"{path}.content", "must be a string or a list of content blocks")
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _tools(value: Any) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        _invalid("tools", "must be a list")
    tools = []
    for i, tool in enumerate(value):
        path = f"tools.{i}"
        if not isinstance(tool, dict):
            _invalid(path, "tool must be an object")
        kind = tool.get("type")
        if kind is not None and kind != "custom":
            _invalid(
                f"{path}.type", f"server tool {kind!r} is not supported; only custom tools are"
            )
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            _invalid(f"{path}.name", "is required and must be a non-empty string")
        description = tool.get("description")
        if description is not None and not isinstance(description, str):
            _invalid(f"{path}.description", "must be a string")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            _invalid(f"{path}.input_schema", "is required and must be an object")
        function: dict[str, Any] = {"name": name}
        if description:
            function["description"] = description
        function["parameters"] = schema
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(value: Any) -> tuple[str | dict[str, Any] | None, bool | None]:
    if value is None:
        return None, None
    if not isinstance(value, dict):
        _invalid("tool_choice", "must be an object")
    kind = value.get("type")
    disable_parallel = value.get("disable_parallel_tool_use")
    if disable_parallel is not None and not isinstance(disable_parallel, bool):
        _invalid("tool_choice.disable_parallel_tool_use", "must be a boolean")
    parallel = False if disable_parallel else None
    if kind == "tool":
        name = value.get("name")
        if not isinstance(name, str) or not name:
            _invalid("tool_choice.name", "is required when type is 'tool'")
        return {"type": "function", "function": {"name": name}}, parallel
    if isinstance(kind, str) and kind in _TOOL_CHOICES:
        return _TOOL_CHOICES[kind], parallel
    _invalid("tool_choice.type", "must be 'auto', 'any', 'tool' or 'none'")
