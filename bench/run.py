"""`make bench` / `make bench-peers`: run every measurement side by side, print one table.

    python -m bench [--peers] [--quick] [--profile] [--out bench/results/latest.json]

The upstream, hal0d (as shipped, plus a stall-guard-off and a metrics-off instance), nginx and
LiteLLM (with --peers) run as separate processes on free loopback ports; this process is the
client. See bench/README.md for what each row means.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench import (
    client,
    context,
    failover,
    inprocess,
    keepalive,
    lifecycle,
    placement,
    procs,
    router,
    router_rows,
    shares,
    swaps,
    warm,
)
from bench.client import CHAT, MESSAGES, Endpoint, chat_body, messages_body
from bench.runs import Plan, Run, say, verdict

RESULTS = procs.ROOT / "bench" / "results"

TARGET_ADDED_MS = 0.5
TARGET_RATIO = 0.6
TARGET_TRANSLATOR_US = 10.0
TARGET_KB_PER_STREAM = 30.0
TARGET_LITELLM_FACTOR = 20.0
BASELINE = "hal0d-baseline"  # the --baseline revision's hal0d, measured beside this tree's
FLOOR = "aiohttp-floor"  # bench/floor.py: the bare proxy on hal0d's stack, in the latency rows
LATENCY_BLOCKS = 20  # the hal0d processes' latency pairs, interleaved in this many rounds


# -- the measured sections ------------------------------------------------------------------------

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


async def profile_section(run: Run, hal0d: procs.Child) -> None:
    """py-spy on hal0d under four loads: the single unpaced stream (profile.svg), paced streams
    through /v1 and /llm/v1/messages (one event per read: the per-event path), and sequential
    non-streaming requests (the per-request path). Flame graphs (.svg) and collapsed stacks
    (.txt, for grep and `bench.hot`) land in bench/results/."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not os.path.exists(spy):  # noqa: ASYNC240
        run.skipped["profile"] = "py-spy not installed (pip install py-spy)"
        return
    n = run.plan.single_chunks
    paced = run.plan.paced_chunks
    RESULTS.mkdir(parents=True, exist_ok=True)
    duration = 8

    async def single(s: aiohttp.ClientSession) -> None:
        await client.read_stream(Endpoint("hal0d", s, hal0d.base + CHAT,
                                          chat_body(stream=True, tokens=n), client.JSON_HEADERS))

    async def paced_chat(s: aiohttp.ClientSession) -> None:
        ep = Endpoint("hal0d", s, hal0d.base + CHAT,
                      chat_body(stream=True, tokens=paced, model="paced-20"), client.JSON_HEADERS)
        await asyncio.gather(*(client.read_stream(ep) for _ in range(run.plan.paced_streams)))

    async def paced_messages(s: aiohttp.ClientSession) -> None:
        ep = Endpoint("hal0d", s, hal0d.base + MESSAGES,
                      messages_body(tokens=paced, model="paced-20"), client.ANTHROPIC_HEADERS,
                      end_marker=b"message_stop")
        await asyncio.gather(*(client.read_stream(ep) for _ in range(run.plan.paced_streams)))

    async def requests(s: aiohttp.ClientSession) -> None:
        ep = Endpoint("hal0d", s, hal0d.base + CHAT, chat_body(stream=False),
                      client.JSON_HEADERS)
        for _ in range(200):
            await client.request_time(ep)

    jobs = (("profile", single), ("profile-paced", paced_chat),
            ("profile-paced-messages", paced_messages), ("profile-requests", requests))
    async with client.session() as s:
        for name, load in jobs:
            outputs = {"flamegraph": RESULTS / f"{name}.svg", "raw": RESULTS / f"{name}.txt"}
            spies = [
                subprocess.Popen(  # noqa: ASYNC220
                    [spy, "record", "--pid", str(hal0d.pid), "--rate", "250", "--duration",
                     str(duration), "--format", fmt, "--nonblocking", "-o", str(out)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                for fmt, out in outputs.items()
            ]
            await asyncio.sleep(1.0)
            deadline = time.monotonic() + duration - 1.5
            count = 0
            while time.monotonic() < deadline:
                await load(s)
                count += 1
            for p in spies:
                p.wait(timeout=duration + 30)
            say(f"profile: {name}: {count} loads, {outputs['flamegraph']}")
            run.results.setdefault("profiles", {})[name] = {
                fmt: str(out.relative_to(procs.ROOT)) for fmt, out in outputs.items()
                if out.exists()}


# -- orchestration --------------------------------------------------------------------------------

async def measure(run: Run, peers: bool, profile: bool, sections: set[str],
                  uvloop: bool = False, *, baseline: Path | None = None) -> None:
    procset = procs.Processes(run.workdir)
    try:
        upstream = await procs.start_upstream(procset, run.plan.pace_ms)
        hal0d = await procs.start_hal0d(procset, upstream, "hal0d")
        children = {"hal0d": hal0d}
        if baseline is not None:
            children[BASELINE] = await procs.start_hal0d(procset, upstream, BASELINE,
                                                         command=baseline)
        noguard = await procs.start_hal0d(procset, upstream, "hal0d-noguard", guard=False)
        nometrics = await procs.start_hal0d(procset, upstream, "hal0d-nometrics",
                                            no_metrics=True)
        children.update({"hal0d-noguard": noguard, "hal0d-nometrics": nometrics})
        if uvloop:
            children["hal0d-uvloop"] = await procs.start_hal0d(procset, upstream, "hal0d-uvloop",
                                                               uvloop=True)
        if peers:
            for name, start in (("nginx", procs.start_nginx), ("litellm", procs.start_litellm)):
                try:
                    say(f"starting {name}")
                    children[name] = await start(procset, upstream)
                except RuntimeError as exc:
                    run.skipped[name] = str(exc).splitlines()[0]
                    say(f"skipping {name}: {run.skipped[name]}")
        else:
            run.skipped["nginx"] = run.skipped["litellm"] = "peers run only with make bench-peers"
        bases = {name: c.base for name, c in children.items()}
        pids = {name: c.pid for name, c in children.items()}

        if "latency" in sections:
            floor = await procs.start_floor(procset, upstream, FLOOR)
            await latency_section(
                run, {**{k: v for k, v in bases.items() if k != "hal0d-noguard"},
                      FLOOR: floor.base}, {**pids, FLOOR: floor.pid}, upstream.base)
            floor.stop()
        if "throughput" in sections:
            await throughput_section(run, {"direct": upstream.base, **bases}, pids)
        if "anthropic" in sections:
            await anthropic_section(run, hal0d.base, upstream.base, hal0d.pid)
        if "paced" in sections:
            await paced_section(run, children)
        if "memory" in sections:
            await memory_section(run, procset, upstream)
            if baseline is not None:
                await memory_section(run, procset, upstream, baseline, "memory_baseline")
        if "lifecycle" in sections:
            await lifecycle.measure(run, procset, hal0d, upstream, say)
        if "failover" in sections:
            await failover.measure(run, procset, upstream, say)
        if "keepalive" in sections:
            await keepalive.measure(run, procset, say, baseline=baseline)
        if "swaps" in sections:
            await swaps.measure(run, procset, say)
        if "shares" in sections:
            await shares.measure(run, procset, say)
        if "warm" in sections:
            await warm.measure(run, procset, say, baseline=baseline)
        if "placement" in sections:
            await placement.measure(run, procset, say)
        if "context" in sections:
            await context.measure(run, procset, say)
        if "router" in sections:
            await router.measure(run, procset, say)
        if profile:
            await profile_section(run, hal0d)
    finally:
        procset.stop_all()
        run.results["log_errors"] = log_errors(run.workdir, procset)


# The hal0d processes every section shares: an error in their logs means a figure measured
# something other than its name (a variant whose patch raised in every request's finish, say).
SHARED_HAL0DS = ("hal0d", BASELINE, "hal0d-noguard", "hal0d-nometrics", "hal0d-uvloop")


def log_errors(workdir: Path, procset: procs.Processes) -> dict[str, dict[str, Any]]:
    """Per shared hal0d process, its error lines (JSON logs, `level` error or critical): how
    many, and the first one's event."""
    found: dict[str, dict[str, Any]] = {}
    for name in {child.name for child in procset.children} & set(SHARED_HAL0DS):
        count, first = 0, ""
        with contextlib.suppress(OSError), open(workdir / f"{name}.log", "rb") as log:
            for line in log:
                try:
                    event = orjson.loads(line)
                except orjson.JSONDecodeError:
                    continue  # not one of hal0d's lines (a child's own output)
                if isinstance(event, dict) and event.get("level") in ("error", "critical"):
                    count += 1
                    first = first or str(event.get("event"))
        if count:
            found[name] = {"count": count, "first": first}
    return found


def machine() -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=procs.ROOT,
                                capture_output=True, text=True, check=False).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "hal0d"], cwd=procs.ROOT,
                               capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        commit, dirty = "", ""
    import aiohttp as _aiohttp

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "aiohttp": _aiohttp.__version__,
        "orjson": orjson.__version__,
        "nginx": procs.nginx_version(),
        "litellm": procs.litellm_version(),
        "hal0d_commit": commit + ("+dirty" if dirty else ""),
        "loadavg_start": os.getloadavg(),
    }


# -- the table ------------------------------------------------------------------------------------

def build_rows(run: Run) -> list[dict[str, Any]]:
    r = run.results
    rows: list[dict[str, Any]] = []

    def row(name: str, value: str, target: str, ok: bool | None, note: str = "") -> None:
        rows.append({"row": name, "value": value, "target": target, "verdict": verdict(ok),
                     "note": note})

    def skipped(name: str, target: str, why: str) -> None:
        rows.append({"row": name, "value": "-", "target": target, "verdict": "skipped",
                     "note": why})

    errors = r.get("log_errors", {})
    row("error lines in the hal0d logs", str(sum(e["count"] for e in errors.values())), "0",
        not errors, "; ".join(f"{name}: {e['count']}, first {e['first']}"
                             for name, e in sorted(errors.items())))
    lat, ttfb = r.get("latency", {}), r.get("ttfb", {})
    for key, label in (("latency", "added latency, non-streaming"),
                       ("ttfb", "added time to first byte")):
        table = lat if key == "latency" else ttfb
        if "hal0d" in table:
            h = table["hal0d"]
            row(f"hal0d {label}",
                f"{h['added_ms_median']:.3f} ms med, {h['added_ms_p99']:.3f} p99",
                f"< {TARGET_ADDED_MS} ms med", h["added_ms_median"] < TARGET_ADDED_MS,
                f"direct {h['direct_ms_median']:.3f} ms, {h['pairs']} pairs; hal0d CPU "
                f"{h['cpu_us_per_request']:.0f} us/request")
    for key, label in (("latency", "non-streaming"), ("ttfb", "time to first byte")):
        table = lat if key == "latency" else ttfb
        if FLOOR in table and "hal0d" in table:
            f, h = table[FLOOR], table["hal0d"]
            row(f"aiohttp floor, {label}",
                f"{f['added_ms_median']:.3f} ms med, {f['added_ms_p99']:.3f} p99", "-", None,
                f"CPU {f['cpu_us_per_request']:.0f} us/request (bench/floor.py); hal0d's own "
                f"work over it: {h['cpu_us_per_request'] - f['cpu_us_per_request']:+.0f} "
                f"us/request, {h['added_ms_median'] - f['added_ms_median']:+.3f} ms")
    single, multi = r.get("single", {}), r.get("multi", {})
    for table, label in ((single, "relay 1 stream"), (multi, "relay 64 streams")):
        if "hal0d" not in table:
            continue
        h = table["hal0d"]
        nginx = table.get("nginx")
        ok = h["ratio_median"] >= TARGET_RATIO and h["failed_rounds"] == 0
        target = f">= {TARGET_RATIO} of direct"
        if nginx is not None:
            ok = ok and h["ratio_median"] >= nginx["ratio_median"]
            target += f", >= nginx ({nginx['ratio_median']:.2f})"
        note = (f"rounds {h['ratio_min']:.2f}-{h['ratio_max']:.2f}; "
                f"{h['rate_median']:,.0f} vs direct {table['direct']['rate_median']:,.0f} "
                f"chunks/s; hal0d CPU {h['cpu_us_per_chunk']:.2f} us/chunk")
        if h["failed_rounds"]:
            note += f"; {h['failed_rounds']} rounds with a failed stream"
        if nginx is None:
            note += "; nginx not run"
        row(f"hal0d {label}", f"{h['ratio_median']:.2f} of direct", target, ok, note)
    tr = r.get("translator")
    if tr:
        per_event = tr["transform_per_event"]["us_per_chunk_median"]
        row("anthropic translator, in-process", f"{per_event:.2f} us/chunk",
            f"< {TARGET_TRANSLATOR_US:g} us/chunk", per_event < TARGET_TRANSLATOR_US,
            f"64 KiB reads {tr['transform_64k_reads']['us_per_chunk_median']:.2f}; decoder "
            f"{tr['decoder_per_event']['us_per_chunk_median']:.2f} + loads "
            f"{tr['orjson_loads']['us_per_chunk_median']:.2f} + translator "
            f"{tr['translator_feed']['us_per_chunk_median']:.2f} + encode "
            f"{tr['encode_events']['us_per_chunk_median']:.2f}")
    ae = r.get("anthropic_e2e")
    if ae:
        m = ae["messages"]
        row("anthropic /llm/v1/messages e2e", f"{m['ratio_median']:.2f} of passthrough", "-",
            None if not m["failed_rounds"] else False,
            f"{m['rate_median']:,.0f} vs {ae['passthrough']['rate_median']:,.0f} chunks/s; "
            f"{ae['passthrough']['ratio_median'] / ae['direct']['ratio_median']:.2f} "
            f"passthrough/direct; hal0d CPU {m['cpu_us_per_chunk']:.1f} vs "
            f"{ae['passthrough']['cpu_us_per_chunk']:.1f} us/chunk unpaced")
    mem = r.get("memory")
    if mem:
        ok = mem["kb_per_stream"] < TARGET_KB_PER_STREAM and mem["completed"] == mem["streams"]
        row(f"hal0d RSS per open stream ({mem['streams']})", f"{mem['kb_per_stream']:.1f} KB",
            f"< {TARGET_KB_PER_STREAM:g} KB, all complete", ok,
            f"idle {mem['rss_idle_kb'] / 1024:.1f} MiB, open {mem['rss_open_kb'] / 1024:.1f} "
            f"MiB, {mem['open_when_sampled']} open when sampled, "
            f"{mem['completed']}/{mem['streams']} completed")
    paced = r.get("paced", {})
    if "hal0d" in paced:
        h = paced["hal0d"]
        note = f"{h['events_per_s']:,.0f} events/s"
        if "hal0d-messages" in paced:
            note += f"; /llm/v1/messages {paced['hal0d-messages']['cpu_us_per_event']:.1f}"
        if "nginx" in paced:
            note += f"; nginx {paced['nginx']['cpu_us_per_event']:.1f}"
        failed = sum(p["failed"] for p in paced.values())
        if failed:
            note += f"; {failed} streams failed"
        row("hal0d CPU per relayed event, paced", f"{h['cpu_us_per_event']:.1f} us/event", "-",
            None if not failed else False, note)
    for variant, label in (("hal0d-noguard", "stall guard"), ("hal0d-nometrics", "metrics")):
        parts = []
        value = "-"
        if "hal0d" in paced and variant in paced:
            cost = paced["hal0d"]["cpu_us_per_event"] - paced[variant]["cpu_us_per_event"]
            value = f"{cost:+.1f} us/event"
            parts.append("paced CPU, on - off")
        for table, tl in ((single, "1 stream"), (multi, "64 streams")):
            if "hal0d" in table and variant in table:
                on, off = table["hal0d"], table[variant]
                parts.append(f"{tl} unpaced: {on['ratio_median']:.2f} on vs "
                             f"{off['ratio_median']:.2f} off, CPU "
                             f"{on['cpu_us_per_chunk'] - off['cpu_us_per_chunk']:+.2f} us/chunk")
        if parts:
            row(f"{label} cost, streaming", value, "-", None, "; ".join(parts))
    if "hal0d-nometrics" in lat and "hal0d" in lat:
        on, off = lat["hal0d"], lat["hal0d-nometrics"]
        row("metrics cost, latency",
            f"{on['added_ms_median'] - off['added_ms_median']:+.3f} ms", "-", None,
            f"added {on['added_ms_median']:.3f} on, {off['added_ms_median']:.3f} off; CPU "
            f"{on['cpu_us_per_request'] - off['cpu_us_per_request']:+.0f} us/request "
            "(history row, Prometheus, tap)")
    if tr:
        row("metrics tap, in-process", f"{tr['tap_per_event']['us_per_chunk_median']:.2f} "
            "us/chunk", "-", None,
            f"64 KiB reads {tr['tap_64k_reads']['us_per_chunk_median']:.2f} us/chunk")

    if "hal0d-uvloop" in lat or "hal0d-uvloop" in single:
        parts = []
        if "hal0d-uvloop" in lat:
            parts.append(f"added latency {lat['hal0d-uvloop']['added_ms_median']:.3f} ms, CPU "
                         f"{lat['hal0d-uvloop']['cpu_us_per_request']:.0f} us/request")
        if "hal0d-uvloop" in ttfb:
            parts.append(f"TTFB {ttfb['hal0d-uvloop']['added_ms_median']:.3f} ms")
        for table, tl in ((single, "1 stream"), (multi, "64 streams")):
            if "hal0d-uvloop" in table:
                parts.append(f"{tl} {table['hal0d-uvloop']['ratio_median']:.2f}")
        if "hal0d-uvloop" in paced:
            parts.append(f"paced {paced['hal0d-uvloop']['cpu_us_per_event']:.1f} us/event")
        row("experiment: hal0d on uvloop", "see note", "-", None, "; ".join(parts))
    for peer, label in (("nginx", "nginx"), ("litellm", "LiteLLM")):
        if peer in run.skipped:
            skipped(f"{label} (peer)", "-", run.skipped[peer])
            continue
        if peer in lat:
            p = lat[peer]
            row(f"{label} added latency, non-streaming",
                f"{p['added_ms_median']:.3f} ms med, {p['added_ms_p99']:.3f} p99", "-", None,
                f"{p['pairs']} pairs; CPU {p['cpu_us_per_request']:.0f} us/request")
        if peer in ttfb:
            p = ttfb[peer]
            row(f"{label} added time to first byte",
                f"{p['added_ms_median']:.3f} ms med, {p['added_ms_p99']:.3f} p99", "-", None)
        for table, tl in ((single, "1 stream"), (multi, "64 streams")):
            if peer in table:
                p = table[peer]
                cpu = p["cpu_us_per_chunk"]
                digits = 2 if p["ratio_median"] >= 0.1 else 4
                row(f"{label} relay {tl}", f"{p['ratio_median']:.{digits}f} of direct", "-",
                    False if p["failed_rounds"] else None,
                    f"rounds {p['ratio_min']:.{digits}f}-{p['ratio_max']:.{digits}f}; "
                    f"{p['rate_median']:,.0f} chunks/s"
                    + (f"; CPU {cpu:.2f} us/chunk" if cpu is not None else "")
                    + (f"; {p['failed_rounds']} failed rounds" if p["failed_rounds"] else ""))
    if "litellm" in lat and "hal0d" in lat:
        factor = lat["litellm"]["added_ms_median"] / max(lat["hal0d"]["added_ms_median"], 1e-6)
        row("LiteLLM added latency / hal0d's", f"{factor:.1f}x",
            f">= {TARGET_LITELLM_FACTOR:g}x", factor >= TARGET_LITELLM_FACTOR)
    elif "litellm" in run.skipped:
        skipped("LiteLLM added latency / hal0d's", f">= {TARGET_LITELLM_FACTOR:g}x",
                "LiteLLM not run")
    rows.extend(lifecycle.rows(run))
    rows.extend(failover.rows(run))
    rows.extend(keepalive.rows(run))
    rows.extend(swaps.rows(run))
    rows.extend(shares.rows(run))
    rows.extend(warm.rows(run))
    rows.extend(placement.rows(run))
    rows.extend(context.rows(run))
    rows.extend(router_rows.rows(run))
    return rows


def baseline_rows(run: Run) -> list[dict[str, Any]]:
    """With --baseline: each hal0d figure beside the baseline revision's, and their ratio
    (this tree / baseline; below 1 is cheaper or faster, except the relay ratios)."""
    r = run.results
    rows: list[dict[str, Any]] = []

    def row(name: str, ours: float | None, theirs: float | None, unit: str, *, digits: int,
            note: str = "") -> None:
        if ours is None or theirs is None:
            return
        ratio = ours / theirs if theirs else float("nan")
        rows.append({"row": f"vs baseline: {name}",
                     "value": f"{ours:.{digits}f} vs {theirs:.{digits}f} {unit}",
                     "target": "-", "verdict": "info", "note": f"ratio {ratio:.2f}; {note}"
                     if note else f"ratio {ratio:.2f}"})

    for table, label in (("latency", "non-streaming"), ("ttfb", "time to first byte")):
        t = r.get(table, {})
        if "hal0d" in t and BASELINE in t:
            ours, theirs = t["hal0d"], t[BASELINE]
            row(f"added latency p50, {label}", ours["added_ms_median"],
                theirs["added_ms_median"], "ms", digits=3,
                note=f"p99 {ours['added_ms_p99']:.3f} vs {theirs['added_ms_p99']:.3f} ms")
            row(f"CPU per request, {label}", ours["cpu_us_per_request"],
                theirs["cpu_us_per_request"], "us", digits=0)
    for table, label in (("single", "1 stream"), ("multi", "64 streams")):
        t = r.get(table, {})
        if "hal0d" in t and BASELINE in t:
            ours, theirs = t["hal0d"], t[BASELINE]
            row(f"relay {label}, of direct", ours["ratio_median"], theirs["ratio_median"], "",
                digits=2, note=f"failed rounds {ours['failed_rounds']} vs "
                f"{theirs['failed_rounds']}")
            row(f"relay {label}, CPU per chunk", ours["cpu_us_per_chunk"],
                theirs["cpu_us_per_chunk"], "us", digits=2)
    paced = r.get("paced", {})
    if "hal0d" in paced and BASELINE in paced:
        row("CPU per relayed event, paced", paced["hal0d"]["cpu_us_per_event"],
            paced[BASELINE]["cpu_us_per_event"], "us", digits=1)
    if "memory" in r and "memory_baseline" in r:
        ours, theirs = r["memory"], r["memory_baseline"]
        row("RSS per open stream", ours["kb_per_stream"], theirs["kb_per_stream"], "KB", digits=1,
            note=f"completed {ours['completed']} vs {theirs['completed']}/{theirs['streams']}")
    return rows


def render(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    heads = ("row", "value", "target", "verdict", "note")
    widths = {h: max(len(h), *(len(str(r[h])) for r in rows)) for h in heads[:-1]}
    lines = [
        f"hal0d bench, {meta['date']}, {meta['machine']['cpu']} x{meta['machine']['cores']}, "
        f"Python {meta['machine']['python']}, aiohttp {meta['machine']['aiohttp']}, "
        f"hal0d {meta['machine']['hal0d_commit']}, {meta['duration_s']:.0f} s"
        + (f", baseline {meta['machine']['baseline']}" if "baseline" in meta["machine"] else ""),
        "  ".join(h.ljust(widths.get(h, 0)) for h in heads).rstrip(),
        "  ".join("-" * widths.get(h, 4) for h in heads).rstrip(),
    ]
    for r in rows:
        lines.append("  ".join(str(r[h]).ljust(widths.get(h, 0)) for h in heads).rstrip())
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("--peers", action="store_true", help="add nginx and LiteLLM rows")
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--profile", action="store_true",
                        help="py-spy hal0d during long streams; writes bench/results/profile*")
    parser.add_argument("--sections",
                        default="latency,throughput,anthropic,paced,memory,lifecycle,failover,"
                        "keepalive,swaps,shares,warm,placement,context",
                        help="comma-separated subset of the default, or `router` (not in the "
                        "default: `make bench-router`, ~11 min on llama-server)")
    parser.add_argument("--uvloop", action="store_true",
                        help="experiment: add a hal0d-uvloop instance (bench/.peers/uvloop)")
    parser.add_argument("--baseline", metavar="REV[+PATCH...]",
                        help="also measure hal0d at git revision REV (installed in "
                        "bench/.peers/baseline-<commit>) side by side; rows for both and ratio; "
                        "+PATCH applies a patch file to REV's tree first (bench/counterfactuals)")
    parser.add_argument("--out", type=Path, default=RESULTS / "latest.json")
    parser.add_argument("--keep-logs", action="store_true",
                        help="keep the run folder (configs, process logs)")
    args = parser.parse_args(argv)
    if "router" in args.sections.split(",") and (problem := router.problem()):
        parser.error(problem)  # before the other sections spend their minutes

    procs.raise_nofile()
    plan = Plan.quick() if args.quick else Plan()
    workdir = Path(tempfile.mkdtemp(prefix="hal0d-bench-"))
    run = Run(plan, workdir)
    meta_machine = machine()
    baseline = None
    if args.baseline:
        say(f"baseline: installing hal0d at {args.baseline}")
        baseline, meta_machine["baseline_commit"] = procs.install_baseline(args.baseline)
        meta_machine["baseline"] = args.baseline
    say(f"run folder {workdir}")
    try:
        asyncio.run(measure(run, args.peers, args.profile, set(args.sections.split(",")),
                            args.uvloop, baseline=baseline))
    finally:
        if args.keep_logs:
            say(f"logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    meta_machine["loadavg_end"] = os.getloadavg()
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "duration_s": time.time() - run.started,
        "machine": meta_machine,
        "plan": plan.__dict__,
        "peers": args.peers,
        "quick": args.quick,
    }
    rows = build_rows(run) + baseline_rows(run)
    table = render(rows, meta)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(orjson.dumps({"meta": meta, "rows": rows, "results": run.results,
                                       "skipped": run.skipped, "table": table},
                                      option=orjson.OPT_INDENT_2))
    say(f"wrote {args.out}")
    return 0
