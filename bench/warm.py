"""The `warm` rows of `make bench`: conversations that stay warm, on the real llama-server.

llama-server keeps a conversation's prompt in its slot's KV cache, so a next turn reads only its
new tokens. Two things lose that cache: the process stopped (an unload, a swap in a group of
`max_loaded = 1`, a restart) and a route sending the next turn to the other replica. hal0d's
answers: `prompt_cache = "save"` (the slots saved before the process stops, restored after its
next load) and a route's affinity (the replica that last served a conversation first). These
rows measure both, against the same hal0d with prompt_cache off and, with --baseline, that
revision's hal0d (which knows neither: its rows show what happens today).

The model is SmolLM2-135M (Q4_1) under llama.cpp's llama-server, as `make test-real` builds
and fetches them (or HAL0D_REAL_SERVER and HAL0D_REAL_MODEL); without them the rows are
skipped. Each server runs with `--parallel 1`: one KV slot, so "busy" means one request in
flight (max_concurrent = 1, which a route's spill_when_busy reads) and a process's cache is one
conversation. A conversation is a system prompt of notes (seeded words, ~1,250 prompt tokens
with the chat template) and a short question a turn; answers are greedy and short.

    swap out and back   a hal0d per variant (save, off, baseline), all up at once but used one
                        request at a time: slots `a` and `b` (the same gguf) in one group of
                        max_loaded = 1. A conversation's first turn on `a`, then per round: a
                        warm turn (no swap), a request to `b` (evicts `a`), the next turn to `a`
                        (evicts `b`, loads `a`). Rounds rotate the variants. Row: the swapped
                        turn's time to first token with save, against off and the warm turn;
                        target <= 1.5 x warm + the load itself (off's load_ms).
    save and restore    from the same swaps: /api/slots' prompt_cache save_ms and restore_ms,
                        and the wall time they add, save against off round by round, from
                        hal0d's log: `a`'s stop (stopping to stopped) and the tail of its
                        load (the server's `listening` line to ready: the probe, then the
                        restore, which comes before ready). Target: under 100 ms each.
    route of two        a hal0d per variant with two replicas (`--parallel 1 -t 1`: two busy
                        at once on two cores) in a [[routes]] with spill_when_busy: four
                        conversations of four turns, two at a time (the second 0.2 s after
                        the first), 0.5-1.5 s between a conversation's turns (its user reads).
                        Row: prompt tokens read (sum of timings.prompt_n) over the ideal
                        (every token read once: the first turn's prompt, then each later
                        turn's prompt beyond the last one's and its answer); target <= 1.05x.

A swap's `load_ms` (hal0d's history) holds the group's idle grace too: the model just answered,
so a swap waits 0.25 s in case its client comes back (lifecycle/groups.py IDLE_GRACE_S).

The section's parts: this module, the scenario (what each variant is put through, in which
order); bench/warm_conversations.py, the conversations and their streamed turns as the client
sees them; bench/warm_hal0ds.py, the hal0d processes, their configs and what they report (slots,
history, log); bench/warm_rows.py, the figures and the rows with their targets.
"""

from __future__ import annotations

import asyncio
import glob
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench import client, procs
from bench.runs import Run
from bench.warm_conversations import Conversation, short_body, stream_turn
from bench.warm_hal0ds import (
    Hal0d,
    Variant,
    feature_problem,
    history_rows,
    log_events,
    note_pids,
    route_slots,
    start,
    stop,
    swap_slots,
    walls,
    warm_toml,
)

REAL_DIR = Path.home() / ".cache" / "hal0d-real"  # where `make test-real` builds and fetches
SERVER_GLOB = "src/llama_cpp_python-*/vendor/llama.cpp/build/bin/llama-server"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
STAGGER_S = 0.2  # between the two conversations of a pair: each first turn meets a settled plan
THINK_S = (0.5, 1.5)  # between a conversation's turns (seeded): its user reads the answer


@dataclass
class WarmPlan:
    rounds: int = 5  # swap out and back, per variant
    conversations: int = 4  # over the route
    turns: int = 4

    @classmethod
    def quick(cls) -> WarmPlan:
        return cls(rounds=1, conversations=2, turns=3)


def find_real() -> tuple[str, str] | str:
    """llama-server's and the model's paths, or why the rows are skipped."""
    server = os.environ.get("HAL0D_REAL_SERVER") or next(
        iter(sorted(glob.glob(str(REAL_DIR / SERVER_GLOB)))), str(REAL_DIR / SERVER_GLOB))
    model = os.environ.get("HAL0D_REAL_MODEL") or str(REAL_DIR / MODEL_FILE)
    if not os.access(server, os.X_OK):
        return f"llama-server not found ({server}; `make test-real` builds it)"
    if not os.path.isfile(model):
        return f"the model file not found ({model}; `make test-real` fetches it)"
    return server, model


# -- swap out and back ------------------------------------------------------------------------

async def swap_round(session: aiohttp.ClientSession, hal0d: Hal0d, talk: Conversation,
                     r: int) -> dict[str, Any]:
    """A warm turn, a request to `b` (evicts `a`), the next turn to `a` (back)."""
    tag = hal0d.variant.tag
    warm = await stream_turn(session, hal0d.base, talk.body("warm-a"), f"warm-{tag}-{r}-warm")
    talk.answered(warm)
    evict = await stream_turn(session, hal0d.base, short_body("warm-b"), f"warm-{tag}-{r}-evict")
    views_out = await note_pids(session, hal0d)
    back = await stream_turn(session, hal0d.base, talk.body("warm-a"), f"warm-{tag}-{r}-back")
    talk.answered(back)
    views_in = await note_pids(session, hal0d)
    rows = await history_rows(session, hal0d.base, {t.request_id for t in (warm, evict, back)})
    for t in (warm, evict, back):
        t.row = rows.get(t.request_id, {})
    return {"warm": warm.as_dict(), "evict": evict.as_dict(), "back": back.as_dict(),
            "cache_after_unload": views_out.get("a", {}).get("prompt_cache"),
            "cache_after_load": views_in.get("a", {}).get("prompt_cache"),
            "conversations_warm": views_in.get("a", {}).get("conversations_warm")}


async def swaps(procset: procs.Processes, real: tuple[str, str], variants: list[Variant],
                plan: WarmPlan, say: Callable[[str], None]) -> dict[str, Any]:
    hal0ds: list[Hal0d] = []
    out: dict[str, Any] = {}
    try:
        for v in variants:
            port = procs.free_port()
            name = f"hal0d-warm-swap-{v.tag}"
            config = warm_toml(port, name, procset.workdir / name, swap_slots(real, v),
                               groups={"cpu": {"max_loaded": 1}})
            hal0ds.append(await start(procset, name, v, config, port=port,
                                      ready=lambda base: procs.http_ok(base + "/readyz")))
        talks = {h.variant.tag: Conversation("a", seed=7) for h in hal0ds}
        async with client.session() as session:
            for h in hal0ds:
                say(f"warm: swaps, {h.variant.tag}: the conversation's first turn")
                first = await stream_turn(session, h.base, talks[h.variant.tag].body("warm-a"),
                                          f"warm-{h.variant.tag}-first")
                talks[h.variant.tag].answered(first)
                out[h.variant.tag] = {"label": h.variant.label, "first": first.as_dict(),
                                      "rounds": []}
            for r in range(plan.rounds):
                order = hal0ds[r % len(hal0ds):] + hal0ds[:r % len(hal0ds)]
                say(f"warm: swaps, round {r + 1} of {plan.rounds}: "
                    + ", ".join(h.variant.tag for h in order))
                for h in order:
                    out[h.variant.tag]["rounds"].append(
                        await swap_round(session, h, talks[h.variant.tag], r))
                    # the machine's other work (two cores, shared): a figure's context
                    out[h.variant.tag]["rounds"][-1]["loadavg"] = os.getloadavg()[0]
    finally:
        for h in hal0ds:
            stop(h, say)
    for h in hal0ds:
        a = walls(log_events(h.log, ("slot.state_changed", "slot.process_output")), "a")
        # a's first load is the first turn's; each round stops it once and loads it once (its
        # last stop is hal0d's own, at the end)
        out[h.variant.tag]["stops_ms"] = a.stops[:plan.rounds]
        out[h.variant.tag]["loads_ms"] = a.loads[1:plan.rounds + 1]
        out[h.variant.tag]["load_tails_ms"] = a.tails[1:plan.rounds + 1]
        out[h.variant.tag]["log"] = [
            {k: e.get(k) for k in ("event", "slot", "tokens", "ms", "error", "reason")}
            for e in log_events(h.log, ("slot.cache_saved", "slot.cache_restored",
                                        "slot.cache_save_failed", "slot.cache_restore_failed"))]
    return out


# -- a route of two replicas ------------------------------------------------------------------

async def route(procset: procs.Processes, real: tuple[str, str], variant: Variant,
                plan: WarmPlan, say: Callable[[str], None]) -> dict[str, Any]:
    port = procs.free_port()
    name = f"hal0d-warm-route-{variant.tag}"
    config = warm_toml(port, name, procset.workdir / name, route_slots(real),
                       routes=[{"model": "warm", "slots": ["r1", "r2"], "spill_when_busy": True}])
    hal0d = await start(procset, name, variant, config, port=port, ready=procs.slots_ready)
    talks = [Conversation(f"c{i + 1}", seed=100 + i) for i in range(plan.conversations)]
    try:
        async with client.session() as session:
            await note_pids(session, hal0d)

            async def converse(talk: Conversation, delay: float) -> None:
                await asyncio.sleep(delay)
                for k in range(plan.turns):
                    if k:
                        await asyncio.sleep(talk.rng.uniform(*THINK_S))
                    talk.answered(await stream_turn(session, hal0d.base, talk.body("warm"),
                                                    f"warm-route-{talk.name}-{k + 1}"))

            for i in range(0, len(talks), 2):
                pair = talks[i:i + 2]
                say(f"warm: route, {variant.tag}: {' and '.join(t.name for t in pair)}, "
                    f"{plan.turns} turns each")
                await asyncio.gather(*(converse(t, j * STAGGER_S) for j, t in enumerate(pair)))
            rows = await history_rows(session, hal0d.base,
                                      {t.request_id for c in talks for t in c.turns})
    finally:
        stop(hal0d, say)
    for talk in talks:
        for t in talk.turns:
            t.row = rows.get(t.request_id, {})
    read = sum(t.prompt_n or 0 for c in talks for t in c.turns)
    ideal = sum(c.ideal() for c in talks)
    moves = sum(1 for c in talks for a, b in zip(c.turns, c.turns[1:], strict=False)
                if a.row.get("slot") != b.row.get("slot"))
    return {
        "label": variant.label, "read": read, "ideal": ideal, "ratio": read / max(ideal, 1),
        "moves": moves, "later_turns": sum(len(c.turns) - 1 for c in talks),
        "failed": sum(not t.ok for c in talks for t in c.turns),
        "conversations": {c.name: [t.as_dict() for t in c.turns] for c in talks},
    }


# -- the section ------------------------------------------------------------------------------

async def measure(run: Run, procset: procs.Processes, say: Callable[[str], None], *,
                  baseline: Path | None = None) -> None:
    real = find_real()
    if isinstance(real, str):
        run.skipped["warm"] = real
        say(f"skipping the warm rows: {real}")
        return
    plan = WarmPlan.quick() if run.plan.latency_pairs < 1000 else WarmPlan()
    save = Variant("save", "prompt_cache save", prompt_cache="save")
    off = Variant("off", "prompt_cache off")
    variants = [save, off]
    result: dict[str, Any] = {"rounds": plan.rounds, "turns": plan.turns,
                              "conversations": plan.conversations}
    if problem := feature_problem(save, real, procset.workdir / "warm-check"):
        variants.remove(save)
        result["save_skipped"] = problem
        say(f"warm: no save variant: {problem}")
    if baseline is not None:
        variants.append(Variant("baseline", "baseline", command=baseline))
    try:
        result["swaps"] = await swaps(procset, real, variants, plan, say)
        result["route"] = {}
        for v in [Variant("hal0d", "this tree")] + [x for x in variants if x.tag == "baseline"]:
            result["route"][v.tag] = await route(procset, real, v, plan, say)
    except (RuntimeError, client.BenchError) as exc:
        result["error"] = str(exc).splitlines()[0]
        say(f"warm: failed: {exc}")
    run.results["warm"] = result
