"""What a model can do, as Ollama's /api/show says it (`capabilities`), and the model's
`digest`, which changes when they do: a client that caches what it read by the digest
(`llm-ollama` does) sees the change.

Where each comes from, the first that knows:

    the slot's `capabilities` for the model   as declared (config/capabilities.py); `completion`
                                              goes with any but an embedding-only model
    the slot's command                        llama-server's --embedding / --embeddings: an
                                              embedding model
    the upstream's GET /props (llama-server)  completion; tools when its chat template takes
                                              them (chat_template_caps), vision and audio from
                                              its modalities, thinking when its template reasons
    the model file ([[library]] models)       completion; tools when its GGUF chat template
                                              reads `tools`, thinking when it reasons, vision
                                              with a projector (of_file: before a first load)
    nothing known                             completion and tools: what every chat model of an
                                              OpenAI-compatible server is asked for

None of it changes with use: a model is not said to think because it was once seen reasoning
(that came too late for a client's cache, and never changed the digest). Pure (test_purity.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

# Ollama's names (types/model/capability.go), in the order /api/show lists them here.
COMPLETION, TOOLS, VISION, EMBEDDING, THINKING, AUDIO = (
    "completion", "tools", "vision", "embedding", "thinking", "audio")
UNKNOWN: Final = (COMPLETION, TOOLS)
EMBEDDING_FLAGS: Final = frozenset({"--embedding", "--embeddings"})
# What a chat template that reasons names: Qwen3's and DeepSeek's tags, the switch llama-server
# turns thinking off with, the field earlier reasoning is written back from.
_THINKING_MARKS: Final = ("<think>", "enable_thinking", "reasoning_content")


def of_declared(declared: Sequence[str]) -> tuple[str, ...]:
    """The declared capabilities, with `completion` unless the model only embeds."""
    if set(declared) == {EMBEDDING}:
        return (EMBEDDING,)
    return (COMPLETION, *(name for name in declared if name != COMPLETION))


def of_command(command: Sequence[str] | None) -> tuple[str, ...] | None:
    """What the slot's command makes of its model, where it says (an embedding server)."""
    if command and EMBEDDING_FLAGS & set(command):
        return (EMBEDDING,)
    return None


# The flags of /props's chat_template_caps and modalities that of_props reads.
_CAPS: Final = ("supports_tool_calls", "supports_tools", "supports_preserve_reasoning",
                "supports_reasoning_effort")
_MODALITIES: Final = ("vision", "audio")


def essentials(props: Mapping[str, Any]) -> dict[str, Any]:
    """What of llama-server's /props of_props and context_length read, and nothing else: it is
    kept for as long as the server's process runs, and the rest (a chat template of many KiB,
    every sampling default) is not needed. The template is kept as the marks of reasoning it
    holds, which is all of_props looks for in it."""
    kept: dict[str, Any] = {}
    for field, flags in (("chat_template_caps", _CAPS), ("modalities", _MODALITIES)):
        given = props.get(field)
        if isinstance(given, dict):
            kept[field] = {flag: bool(given[flag]) for flag in flags if flag in given}
    template = props.get("chat_template")
    if isinstance(template, str):
        kept["chat_template"] = " ".join(mark for mark in _THINKING_MARKS if mark in template)
    settings = props.get("default_generation_settings")
    if isinstance(settings, dict) and "n_ctx" in settings:
        kept["default_generation_settings"] = {"n_ctx": settings["n_ctx"]}
    return kept


def of_props(props: Mapping[str, Any]) -> tuple[str, ...]:
    """What llama-server's /props says its model can do."""
    caps = props.get("chat_template_caps")
    caps = caps if isinstance(caps, dict) else {}
    modalities = props.get("modalities")
    modalities = modalities if isinstance(modalities, dict) else {}
    template = props.get("chat_template")
    template = template if isinstance(template, str) else ""
    found = [COMPLETION]
    if caps.get("supports_tool_calls") or caps.get("supports_tools"):
        found.append(TOOLS)
    if modalities.get("vision"):
        found.append(VISION)
    if caps.get("supports_preserve_reasoning") or caps.get("supports_reasoning_effort") or any(
            mark in template for mark in _THINKING_MARKS):
        found.append(THINKING)
    if modalities.get("audio"):
        found.append(AUDIO)
    return tuple(found)


def of_file(template: str | None, projector: bool) -> tuple[str, ...]:
    """What a GGUF file says its model can do: its chat template's use of tools and marks of
    reasoning, and vision when a projector goes with it."""
    template = template or ""
    found = [COMPLETION]
    if "tools" in template:
        found.append(TOOLS)
    if projector:
        found.append(VISION)
    if any(mark in template for mark in _THINKING_MARKS):
        found.append(THINKING)
    return tuple(found)


def capabilities(declared: Sequence[str] | None, command: Sequence[str] | None,
                 props: Mapping[str, Any] | None,
                 from_file: Sequence[str] | None = None) -> tuple[str, ...]:
    """The model's capabilities from the first source that knows (the module's docstring)."""
    if declared is not None:
        return of_declared(declared)
    if (commanded := of_command(command)) is not None:
        return commanded
    if props is not None:
        return of_props(props)
    if from_file is not None:
        return tuple(from_file)
    return UNKNOWN


def context_length(props: Mapping[str, Any] | None) -> int:
    """The context a slot of the server holds, from /props (llama-server's n_ctx) or from its
    model list (vLLM's max_model_len); 0 when not known (Ollama's 0)."""
    if props is None:
        return 0
    settings = props.get("default_generation_settings")
    n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else props.get("max_model_len")
    return n_ctx if type(n_ctx) is int and n_ctx > 0 else 0
