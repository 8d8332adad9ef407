"""The swap storm: three on-demand slots in a group that holds one loaded model at a time, under
300 streamed requests for them in random order at concurrency 30, a quarter of whose clients
leave mid-stream. Real sockets, and the real stub started as each slot's command.

What must hold: every request either gets its whole stream or a clean 429/503 in the OpenAI
envelope; no stream that ended was cut (no stall frame); never two of the group's processes
alive at once (sampled every 10 ms from a thread, by /proc); afterwards nothing in flight or
queued anywhere, and once hal0d stops, no stub process left.
"""

from __future__ import annotations

import asyncio
import collections
import random
import time
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from hal0d.config import GroupConfig
from tests.harness.client import CHAT, body, views
from tests.harness.config import build_config, on_demand
from tests.harness.daemons import STARTUP_S, ServerFactory, start
from tests.harness.poll import eventually
from tests.harness.processes import ProcessSampler, stub_pids

REQUESTS = 300
CONCURRENCY = 30
SEED = 13
# A stream is 6 tokens 5 ms apart (the stub's --delay): short next to a swap (~0.3-0.5 s of
# Python start), so the storm is about swapping, and whole streams are quick to check.
MAX_TOKENS = 6
MODELS = {"a": "chat", "b": "think-only", "c": "reasoning"}
DONE = b"data: [DONE]\n\n"


async def one_request(http: aiohttp.ClientSession, url: str, model: str,
                      leave: bool) -> tuple[str, bytes]:
    """The outcome of one streamed request: ok, left, or the status of a clean refusal."""
    request = body(model, stream=True, max_tokens=MAX_TOKENS)
    async with http.post(url, json=request) as resp:
        if resp.status != 200:
            answer = await resp.json()
            assert resp.status in (429, 503), (resp.status, answer)
            assert set(answer) == {"error"} and answer["error"]["code"], answer
            return str(resp.status), b""
        if leave:
            await resp.content.readany()  # mid-stream: the first bytes, then hang up
            resp.close()
            return "left", b""
        return "ok", await resp.read()


async def loads_total(http: aiohttp.ClientSession, url: str) -> int:
    async with http.get(url) as resp:
        text = await resp.text()
    return int(sum(sample.value for family in text_string_to_metric_families(text)
                   for sample in family.samples
                   if sample.name == "hal0d_slot_loads_total"
                   and sample.labels["outcome"] == "ok"))


async def test_a_swap_storm_never_cuts_a_stream_never_overlaps_two_models_and_leaves_nothing(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    group = {"gpu0": GroupConfig("gpu0", max_loaded=1)}
    slots = [on_demand(name, tmp_path, group="gpu0", models=(model,), max_concurrent=CONCURRENCY)
             for name, model in MODELS.items()]
    hal0d = await start(start_hal0d, build_config(tmp_path, *slots, groups=group))
    url = str(hal0d.make_url(CHAT))
    rng = random.Random(SEED)
    plan = [(rng.choice(list(MODELS.values())), rng.random() < 0.25) for _ in range(REQUESTS)]
    work = collections.deque(plan)
    outcomes: collections.Counter[str] = collections.Counter()
    streams: list[bytes] = []

    async def client() -> None:
        while work:
            model, leave = work.popleft()
            outcome, stream = await one_request(http, url, model, leave)
            outcomes[outcome] += 1
            if outcome == "ok":
                streams.append(stream)

    began = time.monotonic()
    with ProcessSampler(str(tmp_path)) as sampler:
        async with asyncio.timeout(120):
            await asyncio.gather(*(client() for _ in range(CONCURRENCY)))
        wall_s = time.monotonic() - began

        async def settled() -> dict[str, Any]:
            found = await views(http, hal0d)
            assert all((v["in_flight"], v["queued"]) == (0, 0) for v in found.values()), found
            return found

        await eventually(settled, STARTUP_S, "nothing in flight or queued")
    swaps = await loads_total(http, str(hal0d.make_url("/metrics")))
    print(f"\nswap storm: {outcomes['ok']} ok, {outcomes['left']} left mid-stream, "
          f"{outcomes['429']} x 429, {outcomes['503']} x 503, {swaps} loads, "
          f"max alive {sampler.most_alive} ({sampler.samples} samples), {wall_s:.1f} s")

    assert sum(outcomes.values()) == REQUESTS
    assert outcomes["left"] == sum(leave for _, leave in plan)
    cut = [s for s in streams if not s.endswith(DONE) or b"x_hal0_stall" in s]
    assert not cut, cut[:3]
    assert sampler.samples > 100 and sampler.most_alive == 1
    await hal0d.close()
    assert not stub_pids(str(tmp_path)), "a slot process outlived hal0d"
