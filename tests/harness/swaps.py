"""What the swap tests share: a group of `max_loaded = 1` whose turns are priced as a test says
(`swap_group`), two on-demand stub models in it that load for LOAD_S (`two_models`), a sampler
that keeps every pid it saw (one per load), and a short streamed request (`streamed`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
from aiohttp.test_utils import TestServer

from hal0d.config import GroupConfig, SlotConfig
from tests.harness.client import CHAT, body
from tests.harness.config import on_demand
from tests.harness.processes import ProcessSampler, stub_pids

LOAD_S = "0.8"  # the stub's --startup-delay: a model that loads for 0.8 s


# A turn of 50 loads (40 s here): what ends it in a test of max_wait_s is that bound.
LONG_TURN_LOADS = 50.0


def swap_group(policy: str, max_wait_s: float | None = None, min_turn_loads: float = 3.0,
               max_swap_share: float = 0.2) -> dict[str, GroupConfig]:
    """A group of max_loaded = 1, its turns priced as by default unless a test says."""
    return {"gpu0": GroupConfig("gpu0", max_loaded=1, policy=policy, max_wait_s=max_wait_s,
                                min_turn_loads=min_turn_loads, max_swap_share=max_swap_share)}


def two_models(where: Path, **keys: Any) -> list[SlotConfig]:
    where.mkdir(exist_ok=True)
    return [on_demand(name, where, "--startup-delay", LOAD_S, group="gpu0", **keys)
            for name in ("a", "b")]


class PidLog(ProcessSampler):
    """The sampler of tests/test_loader.py, also keeping every pid it saw alive: one per
    process the group started, that is one per load."""

    def __init__(self, marker: str) -> None:
        super().__init__(marker)
        self.pids: set[int] = set()

    def run(self) -> None:
        while not self._done.wait(0.01):
            living = stub_pids(self.marker)
            self.pids |= living
            self.most_alive = max(self.most_alive, len(living))
            self.samples += 1


async def streamed(http: aiohttp.ClientSession, hal0d: TestServer, model: str,
                   text: str = "hi") -> int:
    async with http.post(hal0d.make_url(CHAT), json=body(model, text, stream=True)) as resp:
        whole = await resp.read()
        assert resp.status != 200 or whole.endswith(b"data: [DONE]\n\n"), whole[-200:]
        return resp.status
