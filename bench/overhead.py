"""What hal0d itself costs a request, measured against the upstream straight: the sections
`latency` (added latency and time to first byte), `throughput` (the relay of unpaced streams),
`anthropic` (/llm/v1/messages against the passthrough, and the translator in-process), `paced`
(CPU per relayed event) and `memory` (RSS per open stream).

They measure the processes bench/run.py starts once for all of them: hal0d as shipped, its
stall-guard-off and metrics-off variants, the --baseline revision's, and nginx and LiteLLM with
--peers. Each section puts its figures in the run's results; bench/table.py makes them rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench import client, inprocess, procs
from bench.client import CHAT, MESSAGES, Endpoint, chat_body, messages_body
from bench.runs import BASELINE, FLOOR, Run, say

LATENCY_BLOCKS = 20  # the hal0d processes' latency pairs, interleaved in this many rounds


async def latency_section(run: Run, targets: dict[str, str], pids: dict[str, int],
                          upstream: str) -> None:
    """Added latency and time to first byte: each target in pairs with the upstream straight.
    The hal0d processes (this tree's, the baseline's, the variants) are measured interleaved,
    in blocks of pairs, so the ratio of two hal0d versions is not a drift of the machine
    between their turns; a peer is measured on its own, after them."""
    plan = run.plan
    async with client.session() as direct_s, contextlib.AsyncExitStack() as stack:
        direct = {
            "whole": Endpoint("direct", direct_s, upstream + CHAT, chat_body(stream=False),
                              client.JSON_HEADERS),
            "stream": Endpoint("direct", direct_s, upstream + CHAT,
                               chat_body(stream=True, tokens=8), client.JSON_HEADERS),
        }
        endpoints: dict[str, dict[str, Endpoint]] = {"whole": {}, "stream": {}}
        for name, base in targets.items():
            s = await stack.enter_async_context(client.session())
            endpoints["whole"][name] = Endpoint(name, s, base + CHAT, chat_body(stream=False),
                                                client.JSON_HEADERS)
            endpoints["stream"][name] = Endpoint(name, s, base + CHAT,
                                                 chat_body(stream=True, tokens=8),
                                                 client.JSON_HEADERS)
        cpu = {name: functools.partial(procs.cpu_seconds, pids[name]) for name in targets}
        # The floor takes turns with the hal0d processes: hal0d's own work is their difference.
        ours = [name for name in targets if name.startswith("hal0d") or name == FLOOR]
        groups = [ours] + [[name] for name in targets if name not in ours]
        for kind, timer, key in (("whole", client.request_time, "latency"),
                                 ("stream", client.first_byte_time, "ttfb")):
            for group in groups:
                pairs = {"litellm": plan.litellm_latency_pairs}.get(
                    group[0], plan.latency_pairs if group is ours else plan.peer_latency_pairs)
                say(f"{key}: direct vs {', '.join(group)}, {pairs} pairs each"
                    + (", interleaved" if len(group) > 1 else ""))
                results = await client.interleaved_differences(
                    timer, direct[kind], {name: endpoints[kind][name] for name in group},
                    pairs=pairs, warmup=min(plan.warmup, pairs),
                    blocks=LATENCY_BLOCKS if len(group) > 1 else 1, cpu=cpu)
                run.results.setdefault(key, {}).update(results)


def stream_endpoints(sessions: dict[str, aiohttp.ClientSession], bases: dict[str, str],
                     chunks: int) -> list[Endpoint]:
    # role chunk + tokens + finish chunk + [DONE]: relayed unchanged, the count must match
    # (LiteLLM re-frames the stream, so only its ending is checked).
    return [
        Endpoint(name, sessions[name], base + CHAT, chat_body(stream=True, tokens=chunks),
                 client.JSON_HEADERS, events=None if name == "litellm" else chunks + 3)
        for name, base in bases.items()
    ]


async def throughput_section(run: Run, bases: dict[str, str], pids: dict[str, int]) -> None:
    """`bases` includes "direct". LiteLLM is far slower, so it has its own, shorter rounds."""
    plan = run.plan
    cpu = {name: functools.partial(procs.cpu_seconds, pid) for name, pid in pids.items()}
    main = {k: v for k, v in bases.items() if k != "litellm"}
    sessions = {name: client.session() for name in bases}
    try:
        say(f"relay, 1 stream x {plan.single_chunks} chunks, {plan.single_rounds} rounds: "
            + ", ".join(main))
        run.results["single"] = await client.throughput_rounds(
            stream_endpoints(sessions, main, plan.single_chunks), "direct",
            rounds=plan.single_rounds, streams=1, chunks=plan.single_chunks, cpu=cpu)
        say(f"relay, {plan.multi_streams} streams x {plan.multi_chunks} chunks, "
            f"{plan.multi_rounds} rounds: " + ", ".join(main))
        run.results["multi"] = await client.throughput_rounds(
            stream_endpoints(sessions, main, plan.multi_chunks), "direct",
            rounds=plan.multi_rounds, streams=plan.multi_streams, chunks=plan.multi_chunks,
            cpu=cpu)
        if "litellm" in bases:
            pair = {"direct": bases["direct"], "litellm": bases["litellm"]}
            say(f"relay, LiteLLM: 1 stream x {plan.litellm_single_chunks} chunks and "
                f"{plan.multi_streams} x {plan.litellm_multi_chunks}, {plan.litellm_rounds} rounds")
            single = await client.throughput_rounds(
                stream_endpoints(sessions, pair, plan.litellm_single_chunks), "direct",
                rounds=plan.litellm_rounds, streams=1, chunks=plan.litellm_single_chunks, cpu=cpu)
            multi = await client.throughput_rounds(
                stream_endpoints(sessions, pair, plan.litellm_multi_chunks), "direct",
                rounds=plan.litellm_rounds, streams=plan.multi_streams,
                chunks=plan.litellm_multi_chunks, cpu=cpu)
            run.results["single"]["litellm"] = single["litellm"]
            run.results["multi"]["litellm"] = multi["litellm"]
    finally:
        for s in sessions.values():
            await s.close()


async def anthropic_section(run: Run, hal0d: str, upstream: str, pid: int) -> None:
    plan = run.plan
    n = plan.single_chunks
    probe = functools.partial(procs.cpu_seconds, pid)
    cpu = {"passthrough": probe, "messages": probe}
    async with client.session() as direct_s, client.session() as s1, client.session() as s2:
        endpoints = [
            Endpoint("direct", direct_s, upstream + CHAT,
                     chat_body(stream=True, tokens=n, include_usage=True),
                     client.JSON_HEADERS, events=n + 4),
            Endpoint("passthrough", s1, hal0d + CHAT,
                     chat_body(stream=True, tokens=n, include_usage=True),
                     client.JSON_HEADERS, events=n + 4),
            # message_start, content_block_start, n deltas, block stop, message_delta, stop
            Endpoint("messages", s2, hal0d + MESSAGES, messages_body(tokens=n),
                     client.ANTHROPIC_HEADERS, end_marker=b"event: message_stop",
                     events=n + 5),
        ]
        say(f"anthropic: /llm/v1/messages vs /v1/chat/completions, 1 stream x {n} chunks, "
            f"{plan.single_rounds} rounds")
        run.results["anthropic_e2e"] = await client.throughput_rounds(
            endpoints, "passthrough", rounds=plan.single_rounds, streams=1, chunks=n, cpu=cpu)
    say(f"anthropic: translator in-process, {plan.translator_chunks} chunks")
    run.results["translator"] = inprocess.measure(plan.translator_chunks)


async def paced_section(run: Run, children: dict[str, procs.Child]) -> None:
    """CPU per relayed event with paced streams (one event per read), side by side."""
    plan = run.plan
    n = plan.paced_chunks
    chat = chat_body(stream=True, tokens=n, model="paced-20")
    targets: list[tuple[str, procs.Child, str, bytes, dict[str, str], bytes]] = [
        (name, children[name], CHAT, chat, client.JSON_HEADERS, b"data: [DONE]")
        for name in ("hal0d", BASELINE, "hal0d-noguard", "hal0d-nometrics", "hal0d-uvloop",
                     "nginx")
        if name in children
    ]
    targets.insert(1, ("hal0d-messages", children["hal0d"], MESSAGES,
                       messages_body(tokens=n, model="paced-20"), client.ANTHROPIC_HEADERS,
                       b"message_stop"))
    out: dict[str, list[dict[str, Any]]] = {name: [] for name, *_ in targets}
    say(f"paced: {plan.paced_streams} streams, one event every 20 ms, CPU per event over "
        f"{plan.paced_window_s:g} s, {plan.paced_rounds} rounds: " + ", ".join(out))
    async with client.session() as s:
        for r in range(plan.paced_rounds):
            shift = r % len(targets)
            for name, child, path, body, headers, marker in targets[shift:] + targets[:shift]:
                ep = Endpoint(name, s, child.base + path, body, headers, end_marker=marker)
                out[name].append(await client.paced_cpu(
                    ep, plan.paced_streams, functools.partial(procs.cpu_seconds, child.pid),
                    window_s=plan.paced_window_s))
    run.results["paced"] = {
        name: {
            "cpu_us_per_event": client.median([x["cpu_us_per_event"] for x in samples]),
            "events_per_s": client.median([x["events_per_s"] for x in samples]),
            "failed": sum(x["failed"] for x in samples),
            "rounds": samples,
        }
        for name, samples in out.items()
    }


async def memory_section(run: Run, procset: procs.Processes, upstream: procs.Child,
                         command: Path | None = None, key: str = "memory") -> None:
    """A fresh hal0d: idle RSS after a warm-up, then RSS with N slowly paced streams open.
    `command`: another installed hal0d (the baseline's), its figures under `key`."""
    plan = run.plan
    n = plan.memory_streams
    hal0d = await procs.start_hal0d(procset, upstream, f"{key}-hal0d", command=command)
    try:
        url = hal0d.base + CHAT
        async with client.session() as s:
            warm = Endpoint("hal0d", s, url, chat_body(stream=True, tokens=2, model="paced"),
                            client.JSON_HEADERS, events=5)
            for _ in range(3):
                results = await asyncio.gather(*(client.read_stream(warm) for _ in range(50)))
                if not all(r.ok for r in results):
                    raise client.BenchError("memory warm-up streams failed")
            await asyncio.sleep(1.0)
            idle = min(procs.rss_kb(hal0d.pid) for _ in range(3))

            body = chat_body(stream=True, tokens=plan.memory_chunks, model="paced")
            opening = asyncio.Semaphore(64)
            state = {"open": 0, "done": 0}
            all_open = asyncio.Event()

            async def one() -> bool:
                async with opening:
                    resp = await s.post(url, data=body, headers=client.JSON_HEADERS)
                try:
                    if resp.status != 200:
                        return False
                    events = 0
                    tail = b""
                    first = True
                    async for data in resp.content.iter_any():
                        if first:
                            first = False
                            state["open"] += 1
                            if state["open"] == n:
                                all_open.set()
                        events += data.count(b"\n\n")
                        tail = data
                    return events == plan.memory_chunks + 3 and b"[DONE]" in tail
                except (aiohttp.ClientError, OSError):
                    return False
                finally:
                    state["done"] += 1
                    resp.release()

            say(f"memory: opening {n} paced streams ({plan.memory_chunks} chunks, one every "
                f"{plan.pace_ms:g} ms) through a fresh hal0d (idle RSS {idle} KB)")
            t0 = time.perf_counter()
            tasks = [asyncio.create_task(one()) for _ in range(n)]
            stream_s = plan.memory_chunks * plan.pace_ms / 1000
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(all_open.wait(), timeout=stream_s)
            ramp_s = time.perf_counter() - t0
            open_now = state["open"] - state["done"]
            samples = []
            for _ in range(5):
                samples.append(procs.rss_kb(hal0d.pid))
                await asyncio.sleep(0.2)
            held_open = state["open"] - state["done"]
            outcomes = await asyncio.gather(*tasks, return_exceptions=True)
            completed = sum(1 for o in outcomes if o is True)
            await asyncio.sleep(1.0)
            after = procs.rss_kb(hal0d.pid)
        peak = max(samples)
        run.results[key] = {
            "streams": n,
            "chunks_per_stream": plan.memory_chunks,
            "pace_ms": plan.pace_ms,
            "rss_idle_kb": idle,
            "rss_open_kb": peak,
            "rss_samples_kb": samples,
            "rss_after_kb": after,
            "open_when_sampled": min(open_now, held_open),
            "ramp_s": ramp_s,
            "kb_per_stream": (peak - idle) / n,
            "completed": completed,
        }
    finally:
        hal0d.stop()
