"""The table `make bench` prints and writes to its JSON: a row per figure, with its target and
verdict. The rows of the overhead sections (bench/overhead.py) are made here, each other
section's by its own module; with --baseline, the `vs baseline:` rows put each hal0d figure
beside the baseline revision's. `render` lays the rows out as the text table.
"""

from __future__ import annotations

from typing import Any

from bench import (
    context,
    failover,
    keepalive,
    lifecycle,
    placement,
    router_rows,
    shares,
    swaps,
    warm_rows,
)
from bench.runs import BASELINE, FLOOR, Run, verdict

TARGET_ADDED_MS = 0.5
TARGET_RATIO = 0.6
TARGET_TRANSLATOR_US = 10.0
TARGET_KB_PER_STREAM = 30.0
TARGET_LITELLM_FACTOR = 20.0


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
    rows.extend(warm_rows.rows(run))
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
