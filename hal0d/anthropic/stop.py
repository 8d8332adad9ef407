"""Why a message stopped: the one place an OpenAI finish_reason becomes an Anthropic stop_reason.

Shared by the streaming translator and the non-streaming response so the two surfaces can never
disagree about the same upstream answer.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

__all__ = ["anthropic_stop"]

_STOP_REASONS: dict[str, str] = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    # Anthropic's own "refusal" means the model refused; a local filter is not that.
    "content_filter": "end_turn",
}


def anthropic_stop(
    choice: Mapping[str, Any], stop_sequences: Collection[str], *, used_tools: bool
) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for an OpenAI choice that carries its finish_reason.

    The matched stop string is where the upstreams put it: vLLM in `stop_reason` (an int there
    is a stop token id, not a sequence), llama.cpp servers in `stopping_word`. It counts only if
    the client asked for it, since a server may also stop on strings of its own.

    Some servers report "stop" after emitting tool calls; agent loops wait for "tool_use" before
    running tools, so the calls decide.
    """
    finish_reason = choice.get("finish_reason")
    if finish_reason == "stop" and stop_sequences:
        for key in ("stop_reason", "stopping_word"):
            matched = choice.get(key)
            if isinstance(matched, str) and matched in stop_sequences:
                return "stop_sequence", matched
    reason = (
        _STOP_REASONS.get(finish_reason, "end_turn")
        if isinstance(finish_reason, str)
        else "end_turn"
    )
    if reason == "end_turn" and used_tools:
        return "tool_use", None
    return reason, None
