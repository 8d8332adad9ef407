"""Whole answers and model lists in Ollama's shapes (pure): a chat completion as one /api/chat or
/api/generate object, embeddings as /api/embed's, and the slots' models as /api/tags, /api/show
and /api/ps show them.

hal0d knows a model by its slot: `size` and `size_vram` are the slot's `memory_mib` (0
unknown), `digest` is made from the slot and model names and the model's capabilities
(capabilities.py: stable across runs, changed when they change), and `details.slot` names the
slot. A model a `[[library]]` found is known by its file too: /api/tags's `size` is the file's,
`modified_at` its time, and the details and /api/show's model_info say what its GGUF header
says (format, family, parameter size, quantization, the trained context); a slot written by
hand leaves them empty. A
`[[routes]]` model is named as the route it is: `details.route` and `details.slots` (its slots in
their order), in /api/ps also `details.slot`, the one that has it loaded; its digest is the
route's, the same whichever slot serves it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import orjson

from hal0d.config.model import LibraryEntry
from hal0d.ollama.capabilities import UNKNOWN
from hal0d.ollama.stream import DONE_REASONS, NS, Clocks, MalformedChunk, timestamp

MIB = 1024 * 1024
# What "loaded for ever" looks like in Ollama's /api/ps: its largest Duration after now.
FOR_EVER_S = (2**63 - 1) / NS


def whole_answer(completion: object, model: str, clocks: Clocks, *, chat: bool,
                 think: bool | None) -> dict[str, Any]:
    """A non-streamed chat completion as Ollama's one `done` object: the reasoning as
    `thinking` unless the request said `think: false`, and then the content when the model said
    nothing else (the stream's rule, stream.py)."""
    if not isinstance(completion, dict) or not isinstance(completion.get("choices"), list) \
            or not completion["choices"] or not isinstance(completion["choices"][0], dict):
        raise MalformedChunk("upstream answer has no choices")
    choice = completion["choices"][0]
    message = choice.get("message") or {}
    if not isinstance(message, dict):
        raise MalformedChunk("upstream answer: message is not an object")
    content = message.get("content") or ""
    thinking = message.get("reasoning_content") or message.get("reasoning") or ""
    if not isinstance(content, str) or not isinstance(thinking, str):
        raise MalformedChunk("upstream answer: content is not a string")
    obj: dict[str, Any] = {"model": model, "created_at": timestamp(clocks.wall())}
    calls = tool_calls(message.get("tool_calls"))
    think = think is not False
    if not think and not content and not calls:
        content = thinking  # reasoning alone: it is the answer
    if chat:
        out: dict[str, Any] = {"role": "assistant", "content": content}
        if think and thinking:
            out["thinking"] = thinking
        if calls:
            out["tool_calls"] = calls
        obj["message"] = out
    else:
        obj["response"] = content
        if think and thinking:
            obj["thinking"] = thinking
        if calls:
            obj["tool_calls"] = calls
    obj["done"] = True
    obj["done_reason"] = DONE_REASONS.get(str(choice.get("finish_reason")), "stop")
    clocks.first, clocks.last = clocks.opened, clocks.now()
    given = completion.get("usage")
    usage: dict[str, Any] = given if isinstance(given, dict) else {}
    metrics = clocks.metrics()
    obj["total_duration"] = metrics["total_duration"]
    obj["load_duration"] = metrics["load_duration"]
    if type(usage.get("prompt_tokens")) is int:
        obj["prompt_eval_count"] = usage["prompt_tokens"]
    obj["prompt_eval_duration"] = metrics["prompt_eval_duration"]
    if type(usage.get("completion_tokens")) is int:
        obj["eval_count"] = usage["completion_tokens"]
    obj["eval_duration"] = metrics["eval_duration"]
    return obj


def tool_calls(calls: object) -> list[dict[str, Any]]:
    """OpenAI tool calls (arguments a JSON string) as Ollama's (arguments an object)."""
    if not isinstance(calls, list):
        return []
    out = []
    for index, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise MalformedChunk("upstream answer: a tool call has no function name")
        raw = function.get("arguments") or "{}"
        try:
            arguments = orjson.loads(raw) if isinstance(raw, str) else raw
        except orjson.JSONDecodeError:
            raise MalformedChunk("upstream answer: tool call arguments are not JSON") from None
        if not isinstance(arguments, dict):
            raise MalformedChunk("upstream answer: tool call arguments are not an object")
        out.append({"id": call.get("id") or f"call_{index}",
                    "function": {"index": index, "name": function["name"],
                                 "arguments": arguments}})
    return out


def embed_answer(answer: object, model: str, clocks: Clocks, *, legacy: bool) -> dict[str, Any]:
    """OpenAI's embeddings list as /api/embed's `embeddings` (or /api/embeddings' one)."""
    data = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(data, list) or not all(isinstance(item, dict) and
                                             isinstance(item.get("embedding"), list)
                                             for item in data):
        raise MalformedChunk("upstream embeddings answer has no data list")
    vectors = [item["embedding"] for item in sorted(data, key=lambda item: item.get("index", 0))]
    if legacy:
        return {"embedding": vectors[0] if vectors else []}
    metrics = clocks.metrics()
    out: dict[str, Any] = {"model": model, "embeddings": vectors,
                           "total_duration": metrics["total_duration"],
                           "load_duration": metrics["load_duration"]}
    usage = answer.get("usage") if isinstance(answer, dict) else None
    if isinstance(usage, dict) and type(usage.get("prompt_tokens")) is int:
        out["prompt_eval_count"] = usage["prompt_tokens"]
    return out


@dataclass(frozen=True, slots=True)
class Served:
    """One model of a slot or a route, as the model lists show it."""

    model: str
    slot: str | None  # the slot that serves it; a route's: the one that has it loaded, or None
    memory_mib: int | None
    capabilities: tuple[str, ...] = UNKNOWN
    context_length: int = 0  # the context its server holds, 0 when not known
    route: str | None = None  # a [[routes]] model: the route's name
    slots: tuple[str, ...] = ()  # and its slots, in their order
    file: LibraryEntry | None = None  # the model file a [[library]] found


def digest(served: Served) -> str:
    owner = f"route:{served.route}" if served.route else f"{served.slot}:{served.model}"
    can = ",".join(served.capabilities)
    return hashlib.sha256(f"hal0d:{owner}:{can}".encode()).hexdigest()


def details(served: Served) -> dict[str, Any]:
    out: dict[str, Any] = {"parent_model": "", "format": "", "family": "", "families": None,
                           "parameter_size": "", "quantization_level": ""}
    if (file := served.file) is not None:
        out.update(format="gguf", family=file.family, families=[file.family],
                   parameter_size=file.parameter_size, quantization_level=file.quantization)
    if served.route is not None:
        out.update(route=served.route, slots=list(served.slots))
    if served.slot is not None:
        out["slot"] = served.slot
    return out


def size(served: Served) -> int:
    return (served.memory_mib or 0) * MIB


def tags(models: Iterable[Served], modified_at: float) -> dict[str, Any]:
    return {"models": [
        {"name": served.model, "model": served.model,
         "modified_at": timestamp(served.file.modified_at if served.file else modified_at),
         "size": served.file.size_bytes if served.file else size(served),
         "digest": digest(served), "details": details(served)}
        for served in models]}


def show(served: Served, modified_at: float) -> dict[str, Any]:
    info: dict[str, Any] = {"general.architecture": ""}
    if (file := served.file) is not None:
        info.update({"general.architecture": file.family,
                     "general.parameter_count": file.parameters})
        if file.trained_context:
            info[f"{file.family}.context_length"] = file.trained_context
        modified_at = file.modified_at
    if served.route is not None:
        info.update({"hal0d.route": served.route, "hal0d.slots": list(served.slots)})
    else:
        info["hal0d.slot"] = served.slot
    if served.context_length:
        # Ollama's key is `<architecture>.context_length`; litellm (aider) takes any key that
        # ends so as the model's window.
        info["hal0d.context_length"] = served.context_length
    return {"modelfile": "", "parameters": "", "template": "", "details": details(served),
            "model_info": info, "capabilities": list(served.capabilities),
            "modified_at": timestamp(modified_at)}


def ps(loaded: Iterable[tuple[Served, float | None]], wall: float) -> dict[str, Any]:
    """The loaded models, each with the seconds until it unloads (None: never), longest first."""
    rows = []
    for served, expires_in in loaded:
        expires = wall + (FOR_EVER_S if expires_in is None else expires_in)
        rows.append((expires, {"name": served.model, "model": served.model,
                               "size": size(served), "digest": digest(served),
                               "details": details(served),
                               "expires_at": timestamp(min(expires, MAX_WALL)),
                               "size_vram": size(served),
                               "context_length": served.context_length}))
    rows.sort(key=lambda row: -row[0])
    return {"models": [row for _, row in rows]}


# The last instant Python's datetime can show (9999-12-31): "for ever" is shown as that or less.
MAX_WALL = 253402300799.0
