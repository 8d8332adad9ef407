"""The load side: timed requests over aiohttp, and the side-by-side (paired) loops.

Every figure comes from a pair: the same request sent straight to the upstream and through the
proxy, one right after the other, in alternating order, so a drift of the shared machine hits
both halves of a pair alike. Latencies are reported as the per-pair difference, throughputs as
the per-round ratio.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from time import perf_counter
from typing import Any

import aiohttp
import orjson

JSON_HEADERS = {"Content-Type": "application/json", "Authorization": "Bearer sk-bench"}
ANTHROPIC_HEADERS = {"Content-Type": "application/json", "x-api-key": "sk-bench",
                     "anthropic-version": "2023-06-01"}
CHAT = "/v1/chat/completions"
MESSAGES = "/llm/v1/messages"


def chat_body(*, stream: bool, tokens: int = 16, model: str = "bench",
              include_usage: bool = False) -> bytes:
    body: dict[str, Any] = {"model": model, "max_tokens": tokens,
                            "messages": [{"role": "user", "content": "Say hello."}]}
    if stream:
        body["stream"] = True
        if include_usage:
            body["stream_options"] = {"include_usage": True}
    return orjson.dumps(body)


def messages_body(*, tokens: int, model: str = "bench") -> bytes:
    return orjson.dumps({"model": model, "max_tokens": tokens, "stream": True,
                         "messages": [{"role": "user", "content": "Say hello."}]})


def session(limit: int = 0) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=limit, force_close=False),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
        auto_decompress=False,
    )


@dataclass
class Endpoint:
    """Where one kind of request goes on one target."""

    target: str
    session: aiohttp.ClientSession
    url: str
    body: bytes
    headers: dict[str, str]
    # The stream ended as it should: bytes its last read must contain.
    end_marker: bytes = b"data: [DONE]"
    # Exact number of SSE events expected, when the target relays them unchanged.
    events: int | None = None


class BenchError(RuntimeError):
    pass


async def request_time(ep: Endpoint) -> float:
    """A whole non-streaming request, in seconds."""
    t0 = perf_counter()
    async with ep.session.post(ep.url, data=ep.body, headers=ep.headers) as resp:
        data = await resp.read()
        t1 = perf_counter()
    if resp.status != 200 or not data:
        raise BenchError(f"{ep.target}: {resp.status} {data[:200]!r}")
    return t1 - t0


async def first_byte_time(ep: Endpoint) -> float:
    """Request sent to the first byte of the streamed body, in seconds; the rest is drained."""
    t0 = perf_counter()
    async with ep.session.post(ep.url, data=ep.body, headers=ep.headers) as resp:
        if resp.status != 200:
            raise BenchError(f"{ep.target}: {resp.status} {(await resp.read())[:200]!r}")
        first = await resp.content.readany()
        t1 = perf_counter()
        tail = first
        while chunk := await resp.content.readany():
            tail = chunk
    if ep.end_marker not in tail[-200:] and ep.end_marker not in first:
        raise BenchError(f"{ep.target}: stream did not end with {ep.end_marker!r}")
    return t1 - t0


@dataclass
class StreamResult:
    seconds: float
    events: int
    ok: bool


async def read_stream(ep: Endpoint) -> StreamResult:
    """One streamed answer read to its end, counting SSE events (blank-line terminated)."""
    t0 = perf_counter()
    events = 0
    prev_lf = False
    tail = b""
    try:
        async with ep.session.post(ep.url, data=ep.body, headers=ep.headers) as resp:
            if resp.status != 200:
                await resp.read()
                return StreamResult(perf_counter() - t0, 0, False)
            async for data in resp.content.iter_any():
                events += data.count(b"\n\n")
                if prev_lf and data[0] == 0x0A:
                    events += 1
                prev_lf = data[-1] == 0x0A
                tail = data if len(data) >= 64 else tail[-64:] + data
    except (aiohttp.ClientError, OSError):
        return StreamResult(perf_counter() - t0, events, False)
    ok = ep.end_marker in tail[-200:] and (ep.events is None or events == ep.events)
    return StreamResult(perf_counter() - t0, events, ok)


async def concurrent_rate(ep: Endpoint, streams: int, chunks: int) -> tuple[float, bool]:
    """Upstream token chunks per second, summed over `streams` concurrent streams."""
    t0 = perf_counter()
    results = await asyncio.gather(*(read_stream(ep) for _ in range(streams)))
    elapsed = perf_counter() - t0
    return streams * chunks / elapsed, all(r.ok for r in results)


# -- statistics -----------------------------------------------------------------------------------

def pct(values: list[float], p: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered) + 0.5) - 1))]


def median(values: list[float]) -> float:
    return statistics.median(values)


# -- side-by-side loops ---------------------------------------------------------------------------

Timer = Callable[[Endpoint], Awaitable[float]]
CpuProbe = Callable[[], float]


async def paired_differences(timer: Timer, direct: Endpoint, proxied: Endpoint, *, pairs: int,
                             warmup: int, cpu: CpuProbe | None = None) -> dict[str, Any]:
    """`pairs` times: the request direct and through the proxy, alternating which goes first.

    Returns the per-pair difference (proxy - direct) in ms: median, p99, and the two medians;
    with `cpu`, the proxy process's CPU time per request as well.
    """
    return (await interleaved_differences(
        timer, direct, {proxied.target: proxied}, pairs=pairs, warmup=warmup, blocks=1,
        cpu={proxied.target: cpu} if cpu else None))[proxied.target]


@dataclass
class _Pairs:
    diffs: list[float]
    direct_ms: list[float]
    proxied_ms: list[float]
    cpu_s: float = 0.0


async def _pairs(timer: Timer, direct: Endpoint, proxied: Endpoint, *, pairs: int,
                 into: _Pairs, cpu: CpuProbe | None) -> None:
    cpu0 = cpu() if cpu else 0.0
    for i in range(pairs):
        if i % 2:
            d = await timer(direct)
            p = await timer(proxied)
        else:
            p = await timer(proxied)
            d = await timer(direct)
        into.direct_ms.append(d * 1000)
        into.proxied_ms.append(p * 1000)
        into.diffs.append((p - d) * 1000)
    if cpu:
        into.cpu_s += cpu() - cpu0


async def interleaved_differences(
    timer: Timer, direct: Endpoint, proxies: Mapping[str, Endpoint], *, pairs: int, warmup: int,
    blocks: int, cpu: Mapping[str, CpuProbe | None] | None = None,
) -> dict[str, dict[str, Any]]:
    """paired_differences for several proxies at once, in `blocks` rounds: each round runs a
    block of pairs/blocks pairs per proxy, the proxies' order rotating, so a drift of the shared
    machine reaches every proxy alike (two versions of hal0d are compared by their ratio)."""
    for proxied in proxies.values():
        for _ in range(warmup):
            await timer(direct)
            await timer(proxied)
    got = {name: _Pairs([], [], []) for name in proxies}
    names = list(proxies)
    per_block = max(1, pairs // blocks)
    for block in range(blocks):
        shift = block % len(names)
        for name in names[shift:] + names[:shift]:
            probe = cpu.get(name) if cpu else None
            await _pairs(timer, direct, proxies[name], pairs=per_block, into=got[name], cpu=probe)
    results = {}
    for name, done in got.items():
        count = len(done.diffs)
        results[name] = {
            "pairs": count,
            "cpu_us_per_request": done.cpu_s * 1e6 / count if cpu and cpu.get(name) else None,
            "added_ms_median": median(done.diffs),
            "added_ms_p99": pct(done.diffs, 99),
            "direct_ms_median": median(done.direct_ms),
            "proxied_ms_median": median(done.proxied_ms),
            "direct_ms_p99": pct(done.direct_ms, 99),
            "proxied_ms_p99": pct(done.proxied_ms, 99),
        }
    return results


async def throughput_rounds(
    endpoints: list[Endpoint],
    baseline: str,
    *,
    rounds: int,
    streams: int,
    chunks: int,
    cpu: Mapping[str, CpuProbe] | None = None,
) -> dict[str, Any]:
    """Each round runs every endpoint once (the order rotates each round); a target's ratio in
    a round is its rate over the baseline's rate in the same round. Also records, for targets
    with a CPU probe, the target process's CPU time per chunk."""
    cpu = cpu or {}
    rates: dict[str, list[float]] = {ep.target: [] for ep in endpoints}
    cpu_us: dict[str, list[float]] = {name: [] for name in cpu}
    failures: dict[str, int] = {ep.target: 0 for ep in endpoints}
    ratios: dict[str, list[float]] = {ep.target: [] for ep in endpoints}
    for r in range(rounds):
        shift = r % len(endpoints)
        order = endpoints[shift:] + endpoints[:shift]
        this_round: dict[str, float] = {}
        for ep in order:
            before = cpu[ep.target]() if ep.target in cpu else 0.0
            rate, ok = await concurrent_rate(ep, streams, chunks)
            if ep.target in cpu:
                cpu_us[ep.target].append((cpu[ep.target]() - before) * 1e6 / (streams * chunks))
            if not ok:
                failures[ep.target] += 1
            rates[ep.target].append(rate)
            this_round[ep.target] = rate
        for name, rate in this_round.items():
            ratios[name].append(rate / this_round[baseline])
    return {
        name: {
            "rate_median": median(rates[name]),
            "ratio_median": median(ratios[name]),
            "ratio_min": min(ratios[name]),
            "ratio_max": max(ratios[name]),
            "rounds": rounds,
            "failed_rounds": failures[name],
            "cpu_us_per_chunk": median(cpu_us[name]) if cpu_us.get(name) else None,
            "rates": rates[name],
            "ratios": ratios[name],
        }
        for name in rates
    }


# -- paced streams: CPU per relayed event ---------------------------------------------------------

async def paced_cpu(ep: Endpoint, streams: int, cpu: CpuProbe, *, window_s: float,
                    settle_s: float = 0.3, open_timeout_s: float = 10.0) -> dict[str, Any]:
    """`streams` paced streams at once; once all are open, the target's CPU time over a window
    divided by the events the client received in it. Paced, every upstream read is one event,
    so this is the per-event cost of the relay loop (where per-read work shows)."""
    received = 0
    opened = 0
    failed = 0
    all_open = asyncio.Event()

    async def one() -> None:
        nonlocal received, opened, failed
        first = True
        tail = b""
        try:
            async with ep.session.post(ep.url, data=ep.body, headers=ep.headers) as resp:
                if resp.status != 200:
                    failed += 1
                    return
                async for data in resp.content.iter_any():
                    if first:
                        first = False
                        opened += 1
                        if opened == streams:
                            all_open.set()
                    received += data.count(b"\n\n")
                    tail = data
        except (aiohttp.ClientError, OSError):
            failed += 1
            return
        if ep.end_marker not in tail:
            failed += 1

    tasks = [asyncio.create_task(one()) for _ in range(streams)]
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(all_open.wait(), open_timeout_s)
    await asyncio.sleep(settle_s)
    events0, cpu0, t0 = received, cpu(), perf_counter()
    await asyncio.sleep(window_s)
    events1, cpu1, t1 = received, cpu(), perf_counter()
    await asyncio.gather(*tasks)
    events = max(events1 - events0, 1)
    return {
        "cpu_us_per_event": (cpu1 - cpu0) * 1e6 / events,
        "events_per_s": events / (t1 - t0),
        "cpu_share": (cpu1 - cpu0) / (t1 - t0),
        "opened": opened,
        "failed": failed,
    }
