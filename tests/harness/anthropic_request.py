"""An Anthropic Messages request body as the request tests write it: the smallest valid one
(`body()`), to which a test adds or changes top-level keys."""

from __future__ import annotations

from typing import Any


def body(**overrides: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": "claude-alias",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "hi"}],
    }
    out.update(overrides)
    return out
