"""A Responses API request as a chat completion (pure), for a slot whose upstream has no
/v1/responses (`[[slots]] responses = "translate"`); the answer's way back is responses_answer.py.

    Responses request                      chat completion request
    instructions, system/developer         one system message first (chat templates want
      messages before the first other        at most one, at the start); a later one stays
                                             a system message where it is
    input: a string                        one user message
    input items: message                   a message (input_text/output_text parts as text,
                                             input_image as an image_url part; only a user's:
                                             a system, developer or assistant message holds
                                             text only)
                 function_call,            an assistant message's tool_calls (consecutive
                 custom_tool_call,           calls, and the text just before them, are one
                 local_shell_call            assistant message)
                 *_output                  a `tool` message with its tool_call_id
                 reasoning, hosted         dropped: a chat backend cannot read them back
                   tools' calls
    tools: function                        a function tool
           namespace (Codex's)             its functions, each named `<namespace>__<name>`
           custom (free-form input)        a function with one string parameter, `input`
           local_shell                     a function `local_shell` taking `command` (argv)
           web_search, file_search, mcp,   dropped: no chat backend runs them (the handler
             computer use ...              logs which)
    max_output_tokens                      max_tokens (within the slot's max_output_tokens)
    reasoning.effort                       reasoning_effort
    text.format                            response_format
    stream                                 stream, with stream_options.include_usage

A call the model makes comes back as the kind of item its tool was: the ToolMap kept from the
request says which. What a translation cannot honour is refused with InvalidRequest (a 400 in
OpenAI's envelope) before the slot is taken: `previous_response_id`, `store: true` and
`background: true` need an upstream that keeps answers, and `item_reference` items need one too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from hal0d.errors import InvalidRequest

__all__ = [
    "CUSTOM",
    "DROPPED_TOOL_TYPES",
    "FUNCTION",
    "LOCAL_SHELL",
    "ChatRequest",
    "ToolMap",
    "chat_request",
]

FUNCTION, CUSTOM, LOCAL_SHELL = "function", "custom", "local_shell"
NAMESPACE_SEPARATOR = "__"
LOCAL_SHELL_PARAMETERS = {
    "type": "object",
    "properties": {
        "command": {"type": "array", "items": {"type": "string"},
                    "description": "The command to run, as its argument vector."},
        "workdir": {"type": "string", "description": "The working directory."},
        "timeout_ms": {"type": "integer", "description": "The command's time limit."},
    },
    "required": ["command"],
}
CUSTOM_PARAMETERS = {
    "type": "object",
    "properties": {"input": {"type": "string", "description": "The tool's whole input."}},
    "required": ["input"],
}
# The tools a Responses server runs itself: a chat backend has no such thing.
DROPPED_TOOL_TYPES = frozenset({
    "web_search", "web_search_preview", "web_search_2025_08_26", "file_search",
    "computer_use_preview", "computer_use", "code_interpreter", "image_generation", "mcp",
    "tool_search",
})
# The output items of hosted tools, and reasoning: nothing a chat template can take back.
DROPPED_ITEM_TYPES = frozenset({
    "reasoning", "web_search_call", "file_search_call", "computer_call", "computer_call_output",
    "code_interpreter_call", "image_generation_call", "mcp_call", "mcp_list_tools",
    "mcp_approval_request", "mcp_approval_response", "compaction", "tool_search_call",
    "tool_search_output",
})
CALL_ITEMS = frozenset({"function_call", "custom_tool_call", "local_shell_call"})
OUTPUT_ITEMS = frozenset({
    "function_call_output", "custom_tool_call_output", "local_shell_call_output",
})
TEXT_PARTS = frozenset({"input_text", "output_text", "text", "summary_text", "refusal"})
REFUSED = {
    "previous_response_id": "continues a stored answer",
    "store": "asks for the answer to be stored",
    "background": "asks for a background answer",
}
# What the Responses request echoes into the response object, as given.
ECHOED = ("instructions", "metadata", "parallel_tool_calls", "temperature", "top_p",
          "tool_choice", "tools", "text", "reasoning", "max_output_tokens", "user")


@dataclass(frozen=True, slots=True)
class Tool:
    kind: str  # FUNCTION, CUSTOM or LOCAL_SHELL: the item a call of it becomes
    name: str  # the name the client gave it
    namespace: str | None = None


@dataclass(slots=True)
class ToolMap:
    """The chat function names the translation gave the request's tools -> what they are."""

    tools: dict[str, Tool] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)  # the tool types left out

    def add(self, chat_name: str, tool: Tool) -> None:
        self.tools[chat_name] = tool

    def of(self, chat_name: str) -> Tool:
        """A name the request did not give (a model making one up) is a plain function."""
        return self.tools.get(chat_name) or Tool(FUNCTION, chat_name)

    def chat_name(self, kind: str, name: str, namespace: str | None = None) -> str:
        for chat_name, tool in self.tools.items():
            if tool.kind == kind and tool.name == name and tool.namespace == namespace:
                return chat_name
        return f"{namespace}{NAMESPACE_SEPARATOR}{name}" if namespace else name


@dataclass(slots=True)
class ChatRequest:
    """The chat completion to send, and what the answer's translation needs of the request."""

    body: dict[str, Any]
    tools: ToolMap
    echo: dict[str, Any]  # the request's fields the response object repeats
    stream: bool


def chat_request(payload: dict[str, Any], *, served_model: str,
                 max_output_tokens: int | None = None) -> ChatRequest:
    """The chat completion for a Responses request; InvalidRequest for what cannot be
    translated."""
    for key, why in REFUSED.items():
        value = payload.get(key)
        if value not in (None, False) and not (key == "previous_response_id" and value == ""):
            raise InvalidRequest(
                f"'{key}' {why}, which this slot's upstream cannot do: it serves only chat "
                "completions and hal0d translates the Responses API for it (responses = "
                '"translate"); send the whole conversation in \'input\''
                + (" and 'store': false" if key == "store" else ""),
                field=key,
            )
    tools = chat_tools(payload.get("tools"))
    stream = payload.get("stream") is True
    body: dict[str, Any] = {"model": served_model, "messages": messages_of(payload, tools.tools),
                            "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if tools.tools:
        body["tools"] = [chat_tool(name, spec) for name, spec in tool_specs(payload, tools)]
        if (choice := tool_choice(payload.get("tool_choice"), tools)) is not None:
            body["tool_choice"] = choice
        if isinstance(payload.get("parallel_tool_calls"), bool):
            body["parallel_tool_calls"] = payload["parallel_tool_calls"]
    limit = payload.get("max_output_tokens")
    if isinstance(limit, int) or max_output_tokens is not None:
        given = limit if isinstance(limit, int) else None
        body["max_tokens"] = min(x for x in (given, max_output_tokens) if x is not None)
    for key in ("temperature", "top_p", "user", "seed"):
        if payload.get(key) is not None:
            body[key] = payload[key]
    reasoning = payload.get("reasoning")
    if isinstance(reasoning, dict) and isinstance(reasoning.get("effort"), str):
        body["reasoning_effort"] = reasoning["effort"]
    if (response_format := format_of(payload.get("text"))) is not None:
        body["response_format"] = response_format
    echo = {key: payload[key] for key in ECHOED if key in payload}
    return ChatRequest(body=body, tools=tools, echo=echo, stream=stream)


def chat_tools(given: Any) -> ToolMap:
    """Which of the request's tools a chat backend gets, under which names."""
    found = ToolMap()
    if given is None:
        return found
    if not isinstance(given, list):
        raise InvalidRequest("'tools' must be an array", field="tools")
    for index, tool in enumerate(given):
        if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
            raise InvalidRequest(f"tools[{index}] must be an object with a 'type'", field="tools")
        kind = tool["type"]
        if kind in (FUNCTION, CUSTOM):
            found.add(tool_name(tool, index), Tool(kind, tool_name(tool, index)))
        elif kind == LOCAL_SHELL:
            found.add(LOCAL_SHELL, Tool(LOCAL_SHELL, LOCAL_SHELL))
        elif kind == "namespace":
            space = tool_name(tool, index)
            for inner_index, inner in enumerate(tool.get("tools") or ()):
                if isinstance(inner, dict) and inner.get("type") in (FUNCTION, CUSTOM):
                    name = tool_name(inner, inner_index)
                    found.add(f"{space}{NAMESPACE_SEPARATOR}{name}",
                              Tool(inner["type"], name, space))
        else:
            found.dropped.append(kind)
    return found


def tool_name(tool: dict[str, Any], index: int) -> str:
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequest(f"tools[{index}] ({tool.get('type')}) needs a 'name'",
                             field="tools")
    return name


def tool_specs(payload: dict[str, Any], tools: ToolMap) -> list[tuple[str, dict[str, Any]]]:
    """(chat name, the tool as the request gave it) for every tool the translation keeps."""
    given: list[dict[str, Any]] = []
    for tool in payload.get("tools") or ():
        if tool.get("type") == "namespace":
            given += [dict(inner, namespace=tool["name"]) for inner in tool.get("tools") or ()
                      if isinstance(inner, dict)]
        else:
            given.append(tool)
    specs = []
    for spec in given:
        if spec.get("type") not in (FUNCTION, CUSTOM, LOCAL_SHELL):
            continue
        name = spec.get("name", LOCAL_SHELL)
        specs.append((tools.chat_name(spec["type"], name, spec.get("namespace")), spec))
    return specs


def chat_tool(chat_name: str, spec: dict[str, Any]) -> dict[str, Any]:
    kind = spec.get("type")
    if kind == LOCAL_SHELL:
        return {"type": "function", "function": {
            "name": chat_name, "description": "Runs a shell command on the user's machine.",
            "parameters": LOCAL_SHELL_PARAMETERS}}
    given = spec.get("description")
    description: str = given if isinstance(given, str) else ""
    if kind == CUSTOM:
        form = spec.get("format")
        if isinstance(form, dict) and isinstance(form.get("definition"), str):
            description += (f"\nThe input follows this {form.get('syntax', 'grammar')} grammar:"
                            f"\n{form['definition']}")
        return {"type": "function", "function": {
            "name": chat_name, "description": description.strip(),
            "parameters": CUSTOM_PARAMETERS}}
    function: dict[str, Any] = {"name": chat_name, "description": description}
    parameters = spec.get("parameters")
    function["parameters"] = parameters if isinstance(parameters, dict) else {
        "type": "object", "properties": {}}
    return {"type": "function", "function": function}


def tool_choice(choice: Any, tools: ToolMap) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and isinstance(choice.get("name"), str):
        kind = choice.get("type")
        kind = kind if kind in (FUNCTION, CUSTOM) else FUNCTION
        name = tools.chat_name(kind, choice["name"], choice.get("namespace"))
        if name in tools.tools:
            return {"type": "function", "function": {"name": name}}
    return None  # a hosted tool's or an unknown choice: the backend's default, "auto"


def format_of(text: Any) -> dict[str, Any] | None:
    form = text.get("format") if isinstance(text, dict) else None
    if not isinstance(form, dict):
        return None
    if form.get("type") == "json_object":
        return {"type": "json_object"}
    if form.get("type") == "json_schema":
        schema = {key: form[key] for key in ("name", "schema", "strict", "description")
                  if key in form}
        return {"type": "json_schema", "json_schema": schema}
    return None


def messages_of(payload: dict[str, Any], tools: dict[str, Tool]) -> list[dict[str, Any]]:
    """The conversation as chat messages: instructions and the leading system and developer
    messages as one system message first."""
    given = payload.get("input")
    items: list[Any] = [{"role": "user", "content": given}] if isinstance(given, str) else (
        given or [])
    system: list[str] = []
    instructions = payload.get("instructions")
    if isinstance(instructions, str) and instructions:
        system.append(instructions)
    messages: list[dict[str, Any]] = []
    names = ToolMap(tools)
    for index, item in enumerate(items):
        if not isinstance(item, dict):
            raise InvalidRequest(f"input[{index}] must be an object", field="input")
        kind = item.get("type", "message")
        if kind == "message":
            message = message_of(item, index)
            if message["role"] == "system" and not messages:
                system.append(text_of(message["content"]))
            else:
                messages.append(message)
        elif kind in CALL_ITEMS:
            add_call(messages, call_of(item, kind, index, names))
        elif kind in OUTPUT_ITEMS:
            messages.append(output_of(item, index))
        elif kind == "item_reference":
            raise InvalidRequest(
                f"input[{index}] is an item_reference, which needs a stored answer: this slot "
                "serves only chat completions (responses = \"translate\"); send the item itself",
                field="input")
        elif kind not in DROPPED_ITEM_TYPES:
            raise InvalidRequest(f"input[{index}]: an item of type {kind!r} cannot be sent to "
                                 "a chat completions upstream", field="input")
    if system:
        messages.insert(0, {"role": "system", "content": "\n\n".join(system)})
    return messages


def message_of(item: dict[str, Any], index: int) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise InvalidRequest(f"input[{index}].role must be user, assistant, system or "
                             f"developer, not {role!r}", field="input")
    content = item.get("content")
    if isinstance(content, list):
        parts = [part_of(part, index) for part in content]
        for at, part in enumerate(parts):
            if part["type"] != "text" and role != "user":
                # Chat completions take an image only from a user: a system or assistant
                # message's content is text, so it is refused here rather than sent on.
                raise InvalidRequest(
                    f"input[{index}].content[{at}] is an {content[at]['type']} part in a {role} "
                    f"message: a {role} message holds text only (send images in a user "
                    "message)", field="input")
        texts_only = all(part["type"] == "text" for part in parts)
        content = "".join(part["text"] for part in parts) if texts_only else parts
    elif not isinstance(content, str):
        raise InvalidRequest(f"input[{index}].content must be a string or an array",
                             field="input")
    return {"role": "system" if role == "developer" else role, "content": content}


def part_of(part: Any, index: int) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in TEXT_PARTS:
        text = part.get("text", part.get("refusal", ""))
        return {"type": "text", "text": text if isinstance(text, str) else ""}
    if kind == "input_image" and isinstance(part.get("image_url"), str):
        return {"type": "image_url", "image_url": {"url": part["image_url"]}}
    raise InvalidRequest(f"input[{index}]: a content part of type {kind!r} cannot be sent to a "
                         "chat completions upstream (text and image URLs can)", field="input")


def text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def call_of(item: dict[str, Any], kind: str, index: int, names: ToolMap) -> dict[str, Any]:
    call_id = item.get("call_id") or item.get("id")
    if not isinstance(call_id, str) or not call_id:
        raise InvalidRequest(f"input[{index}] ({kind}) needs a 'call_id'", field="input")
    if kind == "local_shell_call":
        action: dict[str, Any] = item["action"] if isinstance(item.get("action"), dict) else {}
        arguments: dict[str, Any] = {"command": action.get("command") or []}
        if action.get("working_directory"):
            arguments["workdir"] = action["working_directory"]
        if action.get("timeout_ms"):
            arguments["timeout_ms"] = action["timeout_ms"]
        name, raw = names.chat_name(LOCAL_SHELL, LOCAL_SHELL), orjson.dumps(arguments).decode()
    elif kind == "custom_tool_call":
        name = names.chat_name(CUSTOM, str(item.get("name", "")), item.get("namespace"))
        raw = orjson.dumps({"input": str(item.get("input", ""))}).decode()
    else:
        name = names.chat_name(FUNCTION, str(item.get("name", "")), item.get("namespace"))
        given = item.get("arguments")
        raw = given if isinstance(given, str) else orjson.dumps(given or {}).decode()
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": raw}}


def add_call(messages: list[dict[str, Any]], call: dict[str, Any]) -> None:
    """A call joins the assistant message just before it (its text, or the calls before it)."""
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant" and isinstance(
            last.get("content"), str | None):
        last.setdefault("tool_calls", []).append(call)
        return
    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def output_of(item: dict[str, Any], index: int) -> dict[str, Any]:
    call_id = item.get("call_id") or item.get("id")
    if not isinstance(call_id, str) or not call_id:
        raise InvalidRequest(f"input[{index}] ({item.get('type')}) needs a 'call_id'",
                             field="input")
    output = item.get("output")
    if isinstance(output, list):
        output = "".join(
            part.get("text", "") if isinstance(part, dict) and isinstance(part.get("text"), str)
            else orjson.dumps(part).decode() for part in output)
    elif isinstance(output, dict):
        output = output.get("content") if isinstance(output.get("content"), str) else (
            orjson.dumps(output).decode())
    elif not isinstance(output, str):
        output = "" if output is None else orjson.dumps(output).decode()
    return {"role": "tool", "tool_call_id": call_id, "content": output}
