"""The protocol modules stay sans-I/O, and the relay and the stall guard know no surface.

Pure modules: importing them must not pull in asyncio or aiohttp, so every rule in them is
testable as "these bytes (or chunks) in, these out". The relay and the stall guard: they move and
watch every surface's streams, so a surface's modules or its wire format have no place in them;
each surface's transform (hal0d/openai/, hal0d/anthropic/) renders its own frames.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PURE_MODULES = (
    "hal0d.protocol.sse",
    "hal0d.protocol.transform",
    "hal0d.protocol.chat_chunk",
    "hal0d.protocol.usage",
    "hal0d.protocol.translating",
    "hal0d.protocol.context_errors",
    "hal0d.anthropic.stream",
    "hal0d.anthropic.request",
    "hal0d.anthropic.response",
    "hal0d.anthropic.transform",
    "hal0d.openai.transform",
    "hal0d.openai.responses",
    "hal0d.response_owners",
    "hal0d.openai.responses_request",
    "hal0d.openai.responses_answer",
    "hal0d.openai.responses_bridge",
    "hal0d.anthropic.native",
    "hal0d.ollama.request",
    "hal0d.ollama.stream",
    "hal0d.ollama.transform",
    "hal0d.ollama.response",
    "hal0d.ollama.capabilities",
)
SURFACE_BLIND_MODULES = ("hal0d.transport.relay", "hal0d.transport.stallguard")
SURFACE_PACKAGES = ("hal0d.openai", "hal0d.anthropic", "hal0d.ollama")
# Wire-format words of a surface: OpenAI's chunk objects and its end-of-stream line.
SURFACE_WORDS = ("chat.completion", "text_completion", "[DONE]")


def imported_after(modules: tuple[str, ...]) -> set[str]:
    """The names in sys.modules after a fresh interpreter imported `modules`."""
    code = (
        "import sys\n"
        f"for name in {modules!r}: __import__(name)\n"
        "print('\\n'.join(sorted(sys.modules)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return set(result.stdout.split())


def test_pure_modules_import_no_event_loop_or_http() -> None:
    assert imported_after(PURE_MODULES) & {"asyncio", "aiohttp"} == set()


def test_relay_and_stall_guard_import_no_surface_directly_or_through_others() -> None:
    for module in SURFACE_BLIND_MODULES:
        surface = sorted(
            name
            for name in imported_after((module,))
            if any(name == pkg or name.startswith(pkg + ".") for pkg in SURFACE_PACKAGES)
        )
        assert surface == [], f"{module} imports surface modules: {surface}"


def test_relay_and_stall_guard_mention_no_surface_wire_format() -> None:
    for module in SURFACE_BLIND_MODULES:
        source = (ROOT / (module.replace(".", "/") + ".py")).read_text()
        found = [word for word in SURFACE_WORDS if word in source]
        assert found == [], f"{module} mentions a surface's wire format: {found}"
