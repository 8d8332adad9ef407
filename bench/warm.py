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
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import tomli_w

from bench import client, procs
from bench.runs import Run, verdict

REAL_DIR = Path.home() / ".cache" / "hal0d-real"  # where `make test-real` builds and fetches
SERVER_GLOB = "src/llama_cpp_python-*/vendor/llama.cpp/build/bin/llama-server"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONTEXT = 4096
NOTE_WORDS = 1220  # ~1,250 prompt tokens with the system prompt and the chat template
ANSWER_TOKENS = 24
STAGGER_S = 0.2  # between the two conversations of a pair: each first turn meets a settled plan
THINK_S = (0.5, 1.5)  # between a conversation's turns (seeded): its user reads the answer
TARGET_SWAP_FACTOR = 1.5
TARGET_READ_RATIO = 1.05
TARGET_SAVE_MS = 100.0
LOAD_TIMEOUT_S = 120.0
WORDS = ("river", "stone", "light", "garden", "window", "morning", "paper", "music", "winter",
         "forest", "engine", "market", "silver", "letter", "harbor", "candle", "mountain",
         "bridge", "orchard", "lantern", "meadow", "copper", "valley", "thunder", "pocket",
         "island", "ribbon", "castle", "shadow", "feather")


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


# -- conversations ----------------------------------------------------------------------------

@dataclass
class Turn:
    """One streamed turn as the client saw it; times in seconds from sending it."""

    request_id: str
    status: int = 0
    ttft_s: float | None = None  # the first token of the answer's text
    total_s: float = 0.0
    text: str = ""
    prompt_tokens: int | None = None  # usage: what the client is told
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_n: int | None = None  # timings: what the server read, and took from its cache
    cache_n: int | None = None
    error: str = ""
    row: dict[str, Any] = field(default_factory=dict)  # hal0d's history row of it

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error and self.prompt_n is not None

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "ok": self.ok}


class Conversation:
    """A system prompt of seeded notes and a question a turn; each answer is added to it."""

    def __init__(self, name: str, seed: int) -> None:
        rng = random.Random(seed)
        notes = " ".join(rng.choice(WORDS) for _ in range(NOTE_WORDS))
        self.name = name
        self.rng = rng
        self.messages: list[dict[str, str]] = [
            {"role": "system", "content": f"You answer in one short sentence. Notes {name}: "
                                          + notes},
        ]
        self.turns: list[Turn] = []
        self.ask()

    def ask(self) -> None:
        word = self.rng.choice(WORDS)
        self.messages.append({"role": "user", "content": f"Question {len(self.turns) + 1}: "
                                                         f"where do the notes name the {word}?"})

    def body(self, model: str) -> bytes:
        return orjson.dumps({"model": model, "messages": self.messages, "stream": True,
                             "stream_options": {"include_usage": True},
                             "max_tokens": ANSWER_TOKENS, "temperature": 0})

    def answered(self, turn: Turn) -> None:
        self.turns.append(turn)
        self.messages.append({"role": "assistant", "content": turn.text or "I do not know."})
        self.ask()

    def ideal(self) -> int:
        """Every token of the conversation read once: the first turn's prompt, then each later
        turn's new tokens (its prompt beyond the last one's and the answer the server wrote
        into its cache as it generated it)."""
        total, held = 0, 0
        for t in self.turns:
            if t.prompt_tokens is None:
                continue  # a failed turn: the next one asks what it asked, and more
            total += max(0, t.prompt_tokens - held)
            held = t.prompt_tokens + (t.completion_tokens or 0)
        return total


def short_body(model: str) -> bytes:
    """The other model's request: a swap's cause, short, so its own prompt costs nothing."""
    return orjson.dumps({"model": model, "stream": True, "max_tokens": 4, "temperature": 0,
                         "stream_options": {"include_usage": True},
                         "messages": [{"role": "user", "content": "Say hello."}]})


async def stream_turn(session: aiohttp.ClientSession, base: str, body: bytes,
                      request_id: str) -> Turn:
    """The turn streamed to its end; its text, usage and llama-server's timings read from the
    events (hal0d relays them as the server sent them)."""
    turn = Turn(request_id)
    headers = {**client.JSON_HEADERS, "X-Request-Id": request_id}
    began = time.perf_counter()
    pending = b""
    try:
        async with session.post(base + client.CHAT, data=body, headers=headers) as resp:
            turn.status = resp.status
            if resp.status != 200:
                turn.error = f"status {resp.status}: {(await resp.read())[:200]!r}"
                return turn
            async for piece in resp.content.iter_any():
                pending += piece
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    read_event(turn, line.rstrip(b"\r"), time.perf_counter() - began)
            read_event(turn, pending.rstrip(b"\r"), time.perf_counter() - began)
    except (aiohttp.ClientError, OSError) as exc:
        turn.error = type(exc).__name__
    turn.total_s = time.perf_counter() - began
    if not turn.error and turn.prompt_n is None:
        turn.error = "no timings in the stream"
    return turn


def read_event(turn: Turn, line: bytes, at_s: float) -> None:
    if not line.startswith(b"data:"):
        return  # blank lines, keepalive comments
    data = line[5:].strip()
    if data == b"[DONE]":
        return
    try:
        event = orjson.loads(data)
    except orjson.JSONDecodeError:
        turn.error = f"not JSON: {data[:80]!r}"
        return
    if "error" in event:
        turn.error = f"error event: {str(event['error'])[:120]}"
        return
    for choice in event.get("choices") or ():
        text = (choice.get("delta") or {}).get("content")
        if text:
            turn.text += text
            if turn.ttft_s is None:
                turn.ttft_s = at_s
    if usage := event.get("usage"):
        turn.prompt_tokens = usage.get("prompt_tokens")
        turn.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        turn.completion_tokens = usage.get("completion_tokens")
    if timings := event.get("timings"):
        turn.prompt_n, turn.cache_n = timings.get("prompt_n"), timings.get("cache_n")
    if turn.ttft_s is None and event.get("choices") == [] and turn.prompt_n is not None:
        turn.ttft_s = at_s  # an answer with no text at all: its end stands for its first token


async def history_rows(session: aiohttp.ClientSession, base: str,
                       ids: set[str]) -> dict[str, dict[str, Any]]:
    """hal0d's history rows of these requests (written once each answer is out: retried)."""
    found: dict[str, dict[str, Any]] = {}
    for _ in range(50):
        async with session.get(base + "/api/requests?limit=200") as resp:
            rows = (await resp.json())["requests"]
        found = {r["request_id"]: r for r in rows if r.get("request_id") in ids}
        if len(found) == len(ids):
            break
        await asyncio.sleep(0.1)
    return found


async def slot_views(session: aiohttp.ClientSession, base: str) -> dict[str, dict[str, Any]]:
    async with session.get(base + "/api/slots") as resp:
        return {v["name"]: v for v in (await resp.json())["slots"]}


# -- the hal0d processes ----------------------------------------------------------------------

@dataclass
class Variant:
    tag: str  # save, off, baseline (swaps); hal0d, baseline (route)
    label: str
    command: Path | None = None  # another installed hal0d (the baseline's)
    prompt_cache: str | None = None  # None: no key written (off by default, or unknown)


def server_command(real: tuple[str, str], alias: str, port: int, *, save: bool,
                   threads: int | None = None) -> list[str]:
    server, model = real
    command = [server, "-m", model, "--alias", alias, "--host", "127.0.0.1", "--port", str(port),
               "-c", str(CONTEXT), "--parallel", "1", "--jinja", "--no-webui"]
    if threads is not None:
        command += ["-t", str(threads)]
    if save:
        command += ["--slot-save-path", "{prompt_cache_dir}"]
    return command


def warm_toml(port: int, name: str, folder: Path, slots: list[dict[str, Any]],
              **tables: Any) -> str:
    return f"# generated by bench/warm.py for {name}\n" + tomli_w.dumps({
        "server": {"host": "127.0.0.1", "port": port, "shutdown_grace_s": 5.0},
        "metrics": {"database": str(folder / "history.sqlite3")},
        "logging": {"level": "info", "format": "json"},
        **tables,
        "slots": slots,
    })


def swap_slots(real: tuple[str, str], variant: Variant) -> list[dict[str, Any]]:
    slots = []
    for name in ("a", "b"):
        port = procs.free_port()
        slot: dict[str, Any] = {
            "name": name, "upstream": f"http://127.0.0.1:{port}", "models": [f"warm-{name}"],
            "command": server_command(real, f"warm-{name}", port,
                                      save=variant.prompt_cache == "save"),
            "start": "on_demand", "group": "cpu", "max_concurrent": 1, "max_queue": 8,
            "queue_timeout_s": 300.0, "load_timeout_s": LOAD_TIMEOUT_S,
        }
        if variant.prompt_cache is not None:
            slot["prompt_cache"] = variant.prompt_cache
        slots.append(slot)
    return slots


def route_slots(real: tuple[str, str]) -> list[dict[str, Any]]:
    slots = []
    for name in ("r1", "r2"):
        port = procs.free_port()
        slots.append({
            "name": name, "upstream": f"http://127.0.0.1:{port}", "models": [f"warm-{name}"],
            "command": server_command(real, "warm", port, save=False, threads=1),
            "start": "always", "max_concurrent": 1, "max_queue": 8, "queue_timeout_s": 300.0,
            "load_timeout_s": LOAD_TIMEOUT_S,
        })
    return slots


@dataclass
class Hal0d:
    variant: Variant
    child: procs.Child
    log: Path
    pids: set[int] = field(default_factory=set)  # its llama-servers' pids, as it reported them

    @property
    def base(self) -> str:
        return self.child.base


async def start(procset: procs.Processes, name: str, variant: Variant, config: str, *,
                port: int, ready: Callable[[str], Callable[[aiohttp.ClientSession], object]]
                ) -> Hal0d:
    folder = procset.workdir / name
    folder.mkdir(exist_ok=True)
    path = folder / "hal0d.toml"
    path.write_text(config)
    binary = variant.command or Path(sys.executable).parent / "hal0d"
    # A baseline runs outside the work tree, so this tree's hal0d/ cannot shadow its own.
    child = procset.spawn(name, [str(binary), "serve", "--config", str(path)], port,
                          cwd=folder if variant.command else procs.ROOT)
    await procs.wait_until(child, ready(child.base), LOAD_TIMEOUT_S, procset)
    return Hal0d(variant, child, procset.workdir / f"{name}.log")


def stop(hal0d: Hal0d, say: Callable[[str], None]) -> None:
    """hal0d stopped (SIGTERM: it saves and stops its servers); a llama-server that outlived
    it (hal0d killed before it stopped them) ends by its own process group, hal0d's gift."""
    hal0d.child.stop()
    for pid in hal0d.pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                if b"llama-server" not in cmdline.read():
                    continue  # gone, its pid another process's now
        except OSError:
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
            say(f"warm: llama-server {pid} outlived {hal0d.child.name}; killed its group")


async def note_pids(session: aiohttp.ClientSession, hal0d: Hal0d) -> dict[str, dict[str, Any]]:
    views = await slot_views(session, hal0d.base)
    hal0d.pids.update(v["pid"] for v in views.values() if v.get("pid"))
    return views


def feature_problem(variant: Variant, real: tuple[str, str], folder: Path) -> str | None:
    """Why this tree's hal0d cannot run `variant`'s config (`hal0d check-config`), or None."""
    folder.mkdir(exist_ok=True)
    path = folder / "check.toml"
    path.write_text(warm_toml(procs.free_port(), "check-config", folder, swap_slots(real, variant),
                              groups={"cpu": {"max_loaded": 1}}))
    done = subprocess.run([str(Path(sys.executable).parent / "hal0d"), "check-config", "--config",
                           str(path)], capture_output=True, text=True, check=False)
    if done.returncode == 0:
        return None
    lines = (done.stderr or done.stdout).strip().splitlines()
    return "this tree's hal0d refuses it: " + (lines[0] if lines else f"exit {done.returncode}")


@dataclass
class Walls:
    """Of one slot, in order, in ms, from hal0d's log: each stop (stopping to stopped: the
    save, then the process's exit), each load (starting to ready), and each load's tail (from
    the server's own `listening` line, which hal0d logs as the process's output, to ready: the
    probe, then the restore). The tail leaves out the process's start, which varies by tens of
    ms from one load to the next."""

    stops: list[float] = field(default_factory=list)
    loads: list[float] = field(default_factory=list)
    tails: list[float] = field(default_factory=list)


def walls(events: list[dict[str, Any]], slot: str) -> Walls:
    out = Walls()
    began: dict[str, float] = {}
    for e in events:
        if e.get("slot") != slot or "timestamp" not in e:
            continue
        at = datetime.fromisoformat(e["timestamp"]).timestamp()
        new = e.get("new") if e["event"] == "slot.state_changed" else None
        if new in ("stopping", "starting"):
            began[new] = at
            began.pop("listening", None)
        elif e["event"] == "slot.process_output" and "listening on" in str(e.get("line")):
            began.setdefault("listening", at)
        elif new == "stopped" and "stopping" in began:
            out.stops.append((at - began.pop("stopping")) * 1000)
        elif new == "ready" and "starting" in began:
            out.loads.append((at - began.pop("starting")) * 1000)
            if "listening" in began:
                out.tails.append((at - began.pop("listening")) * 1000)
    return out


def log_events(path: Path, names: tuple[str, ...]) -> list[dict[str, Any]]:
    out = []
    with contextlib.suppress(OSError), path.open("rb") as log:
        for line in log:
            with contextlib.suppress(orjson.JSONDecodeError):
                event = orjson.loads(line)
                if isinstance(event, dict) and event.get("event") in names:
                    out.append(event)
    return out


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
