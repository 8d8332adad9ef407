"""The `warm` rows of `make bench` (the section itself is bench/warm.py): a variant's figures,
medians over its rounds of swaps, and the rows with their targets: the next turn after a swap
out and back, what the save adds to an unload and the restore to a load, and the prompt tokens
read over a route of two replicas against the ideal.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from bench.runs import Run, verdict

TARGET_SWAP_FACTOR = 1.5
TARGET_READ_RATIO = 1.05
TARGET_SAVE_MS = 100.0


def med(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def swap_figures(v: dict[str, Any]) -> dict[str, Any]:
    rounds = v["rounds"]

    def of(key: str, what: Callable[[dict[str, Any]], float | None]) -> float | None:
        values = [x for r in rounds if (x := what(r[key])) is not None]
        return med([float(x) for x in values])

    def cache(key: str, name: str) -> float | None:
        values = [c[name] for r in rounds if (c := r.get(key)) and c.get(name) is not None]
        return med([float(x) for x in values])

    return {
        "warm_ttft_s": of("warm", lambda t: t["ttft_s"]),
        "back_ttft_s": of("back", lambda t: t["ttft_s"]),
        "back_load_s": of("back", lambda t: (t["row"].get("load_ms") or 0) / 1000),
        "back_prompt_tokens": of("back", lambda t: t["prompt_tokens"]),
        "back_cached_tokens": of("back", lambda t: t["cached_tokens"]),
        "back_prompt_n": of("back", lambda t: t["prompt_n"]),
        "warm_prompt_n": of("warm", lambda t: t["prompt_n"]),
        "unload_ms": med(v.get("stops_ms", [])),
        "load_ms": med(v.get("loads_ms", [])),
        "load_tail_ms": med(v.get("load_tails_ms", [])),
        "save_ms": cache("cache_after_unload", "save_ms"),
        "restore_ms": cache("cache_after_load", "restore_ms"),
        "saved_tokens": cache("cache_after_unload", "saved_tokens"),
        "restored_tokens": cache("cache_after_load", "restored_tokens"),
        "loadavg_max": max((r.get("loadavg", 0.0) for r in rounds), default=0.0),
        "failed": sum(not t["ok"] for r in rounds for t in (r["warm"], r["evict"], r["back"]))
        + (not v["first"]["ok"]),
        "errors": sorted({t["error"] for r in rounds for t in (r["warm"], r["evict"], r["back"])
                          if t["error"]}),
    }


def rows(run: Run) -> list[dict[str, Any]]:
    if "warm" in run.skipped:
        return [{"row": "warm rows", "value": "-", "target": "-", "verdict": "skipped",
                 "note": run.skipped["warm"]}]
    r = run.results.get("warm")
    if not r:
        return []
    out: list[dict[str, Any]] = []

    def row(name: str, value: str, target: str, ok: bool | None, note: str) -> None:
        out.append({"row": f"warm: {name}", "value": value, "target": target,
                    "verdict": verdict(ok), "note": note})

    figures = {tag: swap_figures(v) for tag, v in r.get("swaps", {}).items()}
    off, save = figures.get("off"), figures.get("save")
    load_itself = (off or save or {}).get("back_load_s")

    def swap_note(f: dict[str, Any]) -> str:
        note = (f"warm turn {s(f['warm_ttft_s'])}; load_ms {s(f['back_load_s'])}; "
                f"prompt {n(f['back_prompt_tokens'])} tokens, cached {n(f['back_cached_tokens'])}"
                f", read {n(f['back_prompt_n'])}")
        if f["failed"]:
            note += f"; {f['failed']} turns failed: {'; '.join(f['errors'])[:160]}"
        return note

    if save is not None and save["back_ttft_s"] is not None and load_itself is not None:
        bound = TARGET_SWAP_FACTOR * (save["warm_ttft_s"] or 0.0) + load_itself
        ttft = save["back_ttft_s"]
        row("next turn after a swap out and back, save", f"{ttft:.2f} s TTFT",
            f"<= 1.5 x {save['warm_ttft_s']:.2f} warm + {load_itself:.2f} load = {bound:.2f} s",
            ttft <= bound and not save["failed"],
            swap_note(save) + (f"; off's TTFT {s(off['back_ttft_s'])}" if off else "")
            + f"; the load: off's load_ms; {r['rounds']} rounds, medians; 1-min load "
            f"average up to {save['loadavg_max']:.1f}")
    elif "save_skipped" in r:
        out.append({"row": "warm: next turn after a swap out and back, save", "value": "-",
                    "target": "<= 1.5 x warm + load", "verdict": "skipped",
                    "note": r["save_skipped"]})
    for tag in ("off", "baseline"):
        f = figures.get(tag)
        if f is not None and f["back_ttft_s"] is not None:
            row(f"the same, {r['swaps'][tag]['label']}", f"{f['back_ttft_s']:.2f} s TTFT", "-",
                None if not f["failed"] else False, swap_note(f))
    if save is not None:
        swaps_of = r["swaps"]

        def extra(series: str) -> float | None:
            """Save over off, round by round (the rounds took turns, so a drift of the machine
            reaches both alike), the median."""
            on, without = swaps_of["save"].get(series, []), swaps_of.get("off", {}).get(series, [])
            return med([a - b for a, b in zip(on, without, strict=False)])

        def wall(key: str, f: dict[str, Any] | None) -> str:
            return ms(f[key] if f else None)

        stop_extra, tail_extra = extra("stops_ms"), extra("load_tails_ms")
        for what, key, added, tokens, note in (
                ("the save adds to an unload", "save_ms", stop_extra, "saved_tokens",
                 f"a's stop (stopping to stopped) {wall('unload_ms', save)} with vs "
                 f"{wall('unload_ms', off)} without ({ms(stop_extra, sign=True)} a round)"),
                ("the restore adds to a load", "restore_ms", tail_extra, "restored_tokens",
                 f"a's load {wall('load_ms', save)} with vs {wall('load_ms', off)} without "
                 f"(starting to ready; {ms(extra('loads_ms'), sign=True)} a round), of it "
                 f"from the server's listening to ready {wall('load_tail_ms', save)} vs "
                 f"{wall('load_tail_ms', off)} ({ms(tail_extra, sign=True)} a round)")):
            own = save[key]
            ok = (own is not None and own < TARGET_SAVE_MS
                  and (added is None or added < TARGET_SAVE_MS))
            row(what, f"{ms(own)} {key}, {ms(added, sign=True)} wall",
                f"< {TARGET_SAVE_MS:g} ms", ok,
                f"{note}; {n(save[tokens])} tokens; {logged(swaps_of['save'], key)}; "
                f"medians of {r['rounds']}")
    routes = r.get("route", {})
    for tag, v in routes.items():
        ours = tag == "hal0d"
        row("prompt tokens read over a route of 2 replicas / ideal" if ours
            else f"the same, {v['label']}",
            f"{v['ratio']:.2f}x", f"<= {TARGET_READ_RATIO:g}x" if ours else "-",
            (v["ratio"] <= TARGET_READ_RATIO and not v["failed"]) if ours
            else (None if not v["failed"] else False),
            f"read {v['read']:,} of {v['ideal']:,} tokens; {r['conversations']} conversations x "
            f"{r['turns']} turns, 2 at a time; {v['moves']} of {v['later_turns']} later turns "
            f"on another replica" + (f"; {v['failed']} turns failed" if v["failed"] else ""))
    if "error" in r:
        out.append({"row": "warm rows", "value": "-", "target": "-", "verdict": "FAIL",
                    "note": f"the section ended early: {r['error']}"})
    return out


def logged(v: dict[str, Any], key: str) -> str:
    """The log's own line per save or restore of `a` (the last save is hal0d's at its end)."""
    event = "slot.cache_saved" if key == "save_ms" else "slot.cache_restored"
    lines = [e for e in v.get("log", []) if e["event"] == event and e["slot"] == "a"]
    failed = [e for e in v.get("log", []) if e["event"].endswith("_failed")]
    text = f"{len(lines)} {event} lines of a, ms " + "/".join(f"{e['ms']:g}" for e in lines
                                                                if e.get("ms") is not None)
    return text + (f"; {len(failed)} failed: {failed[0]}" if failed else "")


def s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def ms(value: float | None, *, sign: bool = False) -> str:
    return "-" if value is None else (f"{value:+.0f} ms" if sign else f"{value:.0f} ms")


def n(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"
