"""What the Responses bridge's tests share: a Responses request as a client sends it, translated
for a chat upstream (`request`), and the tools a Codex client sends beside its functions (a custom
grammar tool, local_shell, a namespace of functions, and web_search, which a chat backend cannot
run)."""

from __future__ import annotations

from typing import Any

from hal0d.openai.responses_request import ChatRequest, chat_request


def request(**payload: Any) -> ChatRequest:
    return chat_request({"model": "m", "input": "hi", "stream": True, **payload},
                        served_model="served")


CUSTOM_TOOLS = [
    {"type": "custom", "name": "apply_patch", "description": "Patch files.",
     "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
    {"type": "local_shell"},
    {"type": "namespace", "name": "agents", "description": "Sub-agents.",
     "tools": [{"type": "function", "name": "spawn", "parameters": {"type": "object"}}]},
    {"type": "web_search", "external_web_access": True},
]
