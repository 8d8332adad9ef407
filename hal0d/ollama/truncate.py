"""Ollama's way with a conversation longer than the model's context: its oldest messages are left
out until the rest fits, the system prompts and the newest message kept. Ollama does it without
a word (a 160k prompt answered 200 from its last 16k); hal0d does it and says so (the log, the
history row, prompt_eval_count). Pure: messages in, messages out.

What a message weighs is its share of the conversation's text, times the count of the whole: a
cut is measured again after it is made (context_guard.shortened), so the weights need only be
near.
"""

from __future__ import annotations

from typing import Any

import orjson


def weight(message: dict[str, Any]) -> int:
    """The characters a message puts before the model: its content and its tool calls."""
    return len(orjson.dumps([message.get("content"), message.get("tool_calls")]))


def drop_oldest_messages(messages: list[dict[str, Any]], shed: int,
                         counted: int) -> tuple[list[dict[str, Any]], int]:
    """`messages` without the oldest ones worth about `shed` of the `counted` tokens (their
    share of the text), and how many went. System messages stay, and so does the last message;
    a tool's answer goes with the call it answers (a template refuses an answer without its
    call)."""
    droppable = [index for index, message in enumerate(messages[:-1])
                 if message.get("role") != "system"]
    if not droppable:
        return messages, 0
    total = sum(weight(message) for message in messages) or 1
    gone: set[int] = set()
    shed_so_far = 0.0
    for index in droppable:
        if shed_so_far >= shed:
            break
        gone.add(index)
        shed_so_far += counted * weight(messages[index]) / total
    # Answers of calls that went, and leading answers without their call, go too.
    kept_calls = {call.get("id") for index, message in enumerate(messages) if index not in gone
                  for call in message.get("tool_calls") or () if isinstance(call, dict)}
    for index, message in enumerate(messages[:-1]):
        if message.get("role") == "tool" and message.get("tool_call_id") not in kept_calls:
            gone.add(index)
    kept = [message for index, message in enumerate(messages) if index not in gone]
    return kept, len(gone)
