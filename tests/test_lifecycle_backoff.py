"""One process machine for both kinds of slot: an `always` slot whose process dies is started
again with the same backoff an on-demand slot's failed load refuses for, over real processes."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
from structlog.testing import capture_logs

from hal0d.appkeys import LIFECYCLE
from hal0d.config import SlotConfig
from hal0d.lifecycle.runner import BACKOFF_FIRST_S
from tests.conftest import eventually, free_port
from tests.test_loader import (
    Start,
    chat,
    lifecycle_config,
    on_demand,
    start,
    state_is,
    stub_command,
)


def always(name: str, tmp_path: Path) -> SlotConfig:
    port = free_port()
    return SlotConfig(name=name, upstream=f"http://127.0.0.1:{port}", models=("chat",),
                      command=stub_command(port, tmp_path / f"{name}.log"))


def nth(logs: list[dict[str, Any]], event: str, slot: str, n: int) -> dict[str, Any]:
    """The n-th (from 1) `event` of `slot` in the captured log; an AssertionError ("not yet")
    while there are fewer."""
    found = [entry for entry in logs if entry["event"] == event and entry.get("slot") == slot]
    assert len(found) >= n, found
    return found[n - 1]


async def test_an_always_slot_whose_process_dies_is_restarted_with_the_on_demand_backoff(
    start_hal0d: Start, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    failing = on_demand("c", tmp_path, "--fail-start", "error: no such model file")
    hal0d = await start(start_hal0d, lifecycle_config(tmp_path, always("a", tmp_path), failing))
    await state_is(http, hal0d, "a", "ready")
    runner = hal0d.app[LIFECYCLE].runners["a"]
    with capture_logs() as logs:
        for attempt in (1, 2):
            child = runner.child
            assert child is not None
            os.kill(child.pid, signal.SIGKILL)
            exited = await eventually(lambda n=attempt: nth(logs, "slot.process_exited", "a", n),
                                      5, "the always slot's exit")
            seen_exit = time.monotonic()
            await eventually(lambda n=attempt: nth(logs, "slot.process_started", "a", n),
                             BACKOFF_FIRST_S * attempt + 5, "the always slot started again")
            waited = time.monotonic() - seen_exit
            # Not started again before its backoff (the exit is seen at most a poll late).
            assert waited >= exited["restart_in_s"] - 0.1, (waited, exited)
            view = await state_is(http, hal0d, "a", "ready")
            assert view["reason"] is None
            status, answer = await chat(http, hal0d, "tool")
            assert status == 503 and answer["error"]["code"] == "slot.load_failed", answer
            failed = nth(logs, "slot.load_failed", "c", attempt)
            # The same backoff, step for step: 1 s, then 2 s.
            assert exited["restart_in_s"] == failed["retry_in_s"] == BACKOFF_FIRST_S * attempt
            if attempt == 1:
                # Past c's refusal, so that its next load is tried (and fails) again.
                await asyncio.sleep(failed["retry_in_s"])
    assert runner.restarts == 2
