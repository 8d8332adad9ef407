"""The figures of each system of the `router` section (bench/router.py) and its table rows: one
info row a system, then the targets for hal0d with its defaults.

A turn counts as answered when its status was 200 and it ended within the window; the turns in
flight at the window's end are waited for and count toward the latency, the errors and the
prompt tokens (they were work done), not toward the turns. Targets (the issue's): turns at least
TARGET_OF_ALONE of what one model alone gets in the same time; every conversation at least half
the mean turns of a conversation (nobody starved); no errors; p95 and max turn latency within
TARGET_P95_S and TARGET_MAX_S; prompt tokens computed at most TARGET_COMPUTED x the ideal.
"""

from __future__ import annotations

from typing import Any

from bench import client
from bench.conversations import Conversation
from bench.runs import Run, verdict

TARGET_OF_ALONE = 0.85
TARGET_FAIR = 0.5
TARGET_P95_S = 12.0
TARGET_MAX_S = 25.0
TARGET_COMPUTED = 1.15
DEFAULTS = "hal0d"  # the system whose targets are checked
SLOW = "hal0d-slow"


def summary(figures: dict[str, Any]) -> dict[str, Any]:
    """A system's conversations reduced to its figures (and every turn, for the JSON)."""
    talks: list[Conversation] = figures.pop("talks")
    seconds = figures["seconds"]
    turns = [t for c in talks for t in c.turns]
    answered = [t for t in turns if t.ok]
    latencies = [t.latency_s for t in answered]
    per_conversation = {c.name: sum(t.ok and t.ended_s <= seconds for t in c.turns)
                        for c in talks}
    per_model: dict[str, int] = {}
    for c in talks:
        per_model[c.model] = per_model.get(c.model, 0) + per_conversation[c.name]
    errors = [t.error for t in turns if not t.ok]
    return {
        **figures,
        "turns": sum(per_conversation.values()),
        "after_window": sum(t.ended_s > seconds for t in answered),
        "per_model": per_model, "per_conversation": per_conversation,
        "errors": len(errors), "error_kinds": sorted(set(errors))[:3],
        "unfinished": sum(c.in_flight is not None for c in talks),
        "p50_s": client.median(latencies) if latencies else None,
        "p95_s": client.pct(latencies, 95) if latencies else None,
        "max_s": max(latencies, default=None),
        "computed": sum(t.prompt_n or 0 for t in answered),
        "ideal": sum(c.ideal() for c in talks),
        "least_read": sum(c.least_read for c in talks),
        "without_timings": sum(t.prompt_n is None for t in answered),
        "first_prompt": next((t.full_prompt for t in answered), None),
        "started_over": sum(len(c.finished_prompts) for c in talks),
        "turn_log": [{**t.__dict__, "ok": t.ok} for t in turns],
    }


def rows(run: Run) -> list[dict[str, Any]]:
    r = run.results.get("router")
    if not r:
        return []
    systems: dict[str, dict[str, Any]] = r["systems"]
    alone = systems.get("alone", {}).get("turns")
    out = [system_row(key, s, alone, r["seconds"]) for key, s in systems.items()]
    if DEFAULTS in systems and "failed" not in systems[DEFAULTS]:
        out.extend(target_rows(systems[DEFAULTS], alone))
    if SLOW in systems and "failed" not in systems[SLOW]:
        out.extend(swap_rows(systems[SLOW]))
    return out


def system_row(key: str, s: dict[str, Any], alone: int | None,
               seconds: float) -> dict[str, Any]:
    name = f"router: {s['label']}"
    if "failed" in s:
        return {"row": name, "value": "-", "target": "-", "verdict": "FAIL",
                "note": f"did not run: {s['failed'].splitlines()[0][:200]}"}
    value = f"{s['turns']} turns"
    if alone and key != "alone":
        value += f", {s['turns'] / alone:.2f} of alone"
    parts = [
        "per model " + "/".join(str(n) for n in s["per_model"].values()),
        "per conversation " + "/".join(str(n) for n in s["per_conversation"].values()),
        f"{s['errors']} errors" + (f" ({'; '.join(s['error_kinds'])[:160]})"
                                   if s["errors"] else ""),
        f"latency p50 {secs(s['p50_s'])} / p95 {secs(s['p95_s'])} / max {secs(s['max_s'])}",
        f"prompt tokens computed {s['computed']:,} of ideal {s['ideal']:,} "
        f"({s['computed'] / max(s['ideal'], 1):.2f}x)",
        f"{s['loads']} loads",
        f"first prompt {s['first_prompt'] or '-'} tokens",
    ]
    if s["after_window"] or s["unfinished"]:
        parts.append(f"{s['after_window']} answered after the {seconds:g} s window, "
                     f"{s['unfinished']} never")
    if s["started_over"]:
        parts.append(f"{s['started_over']} conversations started over at their context")
    if s["without_timings"]:
        parts.append(f"{s['without_timings']} answers without timings")
    for group in s.get("groups", []):
        parts.append(group_note(group))
    if s.get("log_errors"):
        parts.append(f"hal0d logged {len(s['log_errors'])} errors "
                     f"({', '.join(sorted(set(s['log_errors'])))})")
    return {"row": name, "value": value, "target": "-",
            "verdict": verdict(None if not s["errors"] else False), "note": "; ".join(parts)}


def group_note(group: dict[str, Any]) -> str:
    note = (f"group: {group.get('swaps')} swaps, swap_cost_s {group.get('swap_cost_s')}, "
            f"swap_share {pct(group.get('swap_share'))}")
    if "turn_s" in group:
        note += f", turn_s {group['turn_s']}"
    return note


def target_rows(s: dict[str, Any], alone: int | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def row(what: str, value: str, target: str, ok: bool | None, note: str = "",
            *, skipped: str = "") -> None:
        out.append({"row": f"router: {s['label']}, {what}", "value": value, "target": target,
                    "verdict": "skipped" if skipped else verdict(ok), "note": skipped or note})

    if alone:
        row("turns / one model alone's", f"{s['turns'] / alone:.2f}",
            f">= {TARGET_OF_ALONE:g}", s["turns"] >= TARGET_OF_ALONE * alone,
            f"{s['turns']} vs {alone} turns in the same time")
    else:
        row("turns / one model alone's", "-", f">= {TARGET_OF_ALONE:g}", None,
            skipped="one model alone was not run (or answered nothing)")
    counts = list(s["per_conversation"].values())
    mean = sum(counts) / max(len(counts), 1)
    row("fewest turns of a conversation", f"{min(counts, default=0)} (mean {mean:.1f})",
        f">= {TARGET_FAIR:g} x mean", min(counts, default=0) >= TARGET_FAIR * mean and mean > 0,
        "per conversation " + "/".join(str(n) for n in counts))
    row("errors", str(s["errors"]), "0", s["errors"] == 0,
        "; ".join(s["error_kinds"])[:200])
    p95, worst = s["p95_s"], s["max_s"]
    row("turn latency p95 / max", f"{secs(p95)} / {secs(worst)}",
        f"<= {TARGET_P95_S:g} s / <= {TARGET_MAX_S:g} s",
        p95 is not None and worst is not None and p95 <= TARGET_P95_S
        and worst <= TARGET_MAX_S, f"p50 {secs(s['p50_s'])}")
    ratio = s["computed"] / max(s["ideal"], 1)
    row("prompt tokens computed / ideal", f"{ratio:.2f}x", f"<= {TARGET_COMPUTED:g}x",
        ratio <= TARGET_COMPUTED and s["ideal"] > 0,
        f"{s['computed']:,} computed (sum of timings.prompt_n), ideal {s['ideal']:,} (each "
        f"conversation's last full prompt); {s['computed'] / max(s['least_read'], 1):.2f}x "
        f"of the {s['least_read']:,} a server that keeps every conversation reads (the answers "
        "are in its cache)")
    return out


def swap_rows(s: dict[str, Any]) -> list[dict[str, Any]]:
    """The share of the time spent swapping when every load takes 10 s more."""
    out = []
    for group in s.get("groups", []):
        turns = group.get("min_turn_loads")
        aim = (f"; a turn of at least min_turn_loads {turns:g} loads keeps it near "
               f"1/(1 + {turns:g}) = {pct(1 / (1 + turns))}" if turns else "")
        out.append({"row": f"router: {s['label']}, time swapping",
                    "value": f"{pct(group.get('swap_share'))} swap_share", "target": "-",
                    "verdict": "info",
                    "note": group_note(group) + f"; {s['loads']} loads" + aim})
    return out


def secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"
