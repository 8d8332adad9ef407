"""The protocol modules stay sans-I/O: importing them must not pull in asyncio or aiohttp."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PURE_MODULES = (
    "hal0d.sse",
    "hal0d.anthropic.stream",
    "hal0d.anthropic.request",
    "hal0d.anthropic.response",
)


def test_pure_modules_import_no_event_loop_or_http() -> None:
    code = (
        "import sys\n"
        f"for name in {PURE_MODULES!r}: __import__(name)\n"
        "print(','.join(sorted(m for m in ('asyncio', 'aiohttp') if m in sys.modules)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout.strip() == ""
