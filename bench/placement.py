"""The bench rows for where models go on a box of GPUs: `static` (today's way: a group per GPU
with a memory budget, each slot pinned to its GPU) against `measured` (hal0d reads the devices,
learns each model's footprint and places each load).

The box is the simulated one (hal0d_stub/device.py): two 24 GiB GPUs in a file every process
shares. Each slot's command is the stub loading onto it (`hal0d stub --device-state BOX
--footprint-mib N`): it takes its true footprint on the devices CUDA_VISIBLE_DEVICES names, or
fails its load with llama.cpp's own out-of-memory lines (exit 1) when they lack room. Six models
on demand, of 3, 5, 8, 12, 20 and 30 GiB (the last fits only split over both GPUs), each slot's
`memory_mib` a wrong guess (half or double the truth), each load taking 0.25 s + 50 ms a GiB
(`--startup-delay`) beside the stub's own start, each answer TOKENS tokens TOKEN_DELAY_S apart.

Each variant runs its own hal0d on a fresh box, for the same wall time (SECONDS, or
HAL0D_PLACEMENT_S) and the same arrivals: streamed requests arriving as a Poisson process over
the six models (random.Random(SEED)), the small models asked for more (WEIGHTS). At the
midpoint a desktop takes DESKTOP_MIB on device 0 (the devices command's `--take`, tried again
every half second while device 0 lacks room): memory no model server holds.

- `static`: groups gpu0 and gpu1, each `memory_mib = 24576`, each slot's command run through
  `env CUDA_VISIBLE_DEVICES=N` (a slot has no environment key of its own); the 30 GiB model
  in gpu0 with CUDA_VISIBLE_DEVICES "0,1", as a user would try; no [devices] table.
- `measured`: `[devices] devices_command` reading the box every 0.5 s, no groups, no pinning.

Per variant: the loads (hal0d_slot_loads_total by outcome) and the share of the wall time a
slot was `starting` (/api/slots every SAMPLE_S); the requests answered (200 and a stream that
ends in `data: [DONE]`) with their latency from sending to the stream's end (p50, p95); the
others by status and error code (a stream whose head went out before its load failed ends in
an error frame: "200, then <code>"), those whose body says "out of memory" counted apart; the
most each device held in any sample of the box, against its total; hal0d's own log lines of
out-of-memory loads, retries, placements and unloads. Targets: `measured` shows clients no
out-of-memory failure; in both every request is answered or refused with a code and a message;
no device ever holds more than its total (the simulated box refuses any allocation past it, so
that row checks the simulation: on a real GPU that is the out-of-memory failure itself).
"""

from __future__ import annotations

import asyncio
import collections
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import tomli_w

from bench import client, procs
from bench.runs import Run, verdict
from hal0d_stub import device

GIB = 1024
SECONDS = 60.0  # each variant's wall time of arrivals; HAL0D_PLACEMENT_S overrides it
QUICK_SECONDS = 20.0
SEED = 48
TOTAL_RATE = 1.5  # requests per second over the six models
TOKENS = 16
TOKEN_DELAY_S = 0.05  # 16 tokens: a stream of about 0.8 s
SAMPLE_S = 0.1
DESKTOP_MIB = 2 * GIB
REQUEST_TIMEOUT_S = 180.0  # a request still unanswered after this counts as no answer
VARIANTS = ("static", "measured")
# The lines of hal0d's log a row counts (event name: label).
EVENTS = {"slot.load_out_of_memory": "out-of-memory loads", "slot.load_retrying": "retries",
          "slot.placed": "placements", "slot.unloaded": "unloads before shutdown",
          "slot.footprint_measured": "footprints measured"}


@dataclass(frozen=True)
class Model:
    name: str
    footprint_gib: int
    guess_mib: int  # its slot's memory_mib: wrong
    weight: int  # its share of the arrivals
    gpus: str  # the static variant's pinning: CUDA_VISIBLE_DEVICES, and its group gpu<first>

    @property
    def footprint_mib(self) -> int:
        return self.footprint_gib * GIB

    @property
    def load_s(self) -> float:
        return 0.25 + 0.05 * self.footprint_gib


MODELS = (
    Model("m3", 3, 6 * GIB, 6, "0"),  # double
    Model("m5", 5, 5 * GIB // 2, 5, "1"),  # half
    Model("m8", 8, 16 * GIB, 4, "0"),  # double
    Model("m12", 12, 6 * GIB, 3, "0"),  # half
    Model("m20", 20, 10 * GIB, 2, "1"),  # half
    Model("m30", 30, 15 * GIB, 1, "0,1"),  # half; fits only split over both GPUs
)


def wall_seconds(quick: bool) -> float:
    return float(os.environ.get("HAL0D_PLACEMENT_S", QUICK_SECONDS if quick else SECONDS))


# -- the hal0d of a variant ---------------------------------------------------------------------

def box_command(box: Path) -> list[str]:
    return [sys.executable, "-m", "hal0d_stub.devices", str(box)]


def slot_table(model: Model, port: int, box: Path, variant: str) -> dict[str, Any]:
    command = [sys.executable, "-m", "hal0d", "stub", "--port", str(port), "--delay",
               str(TOKEN_DELAY_S), "--startup-delay", f"{model.load_s:g}", "-a", model.name,
               "--device-state", str(box), "--footprint-mib", str(model.footprint_mib)]
    table: dict[str, Any] = {
        "name": model.name, "upstream": f"http://127.0.0.1:{port}", "models": [model.name],
        "start": "on_demand", "memory_mib": model.guess_mib, "load_timeout_s": 60.0}
    if variant == "static":
        table["command"] = ["env", f"CUDA_VISIBLE_DEVICES={model.gpus}", *command]
        table["group"] = f"gpu{model.gpus[0]}"
    else:
        table["command"] = command
    return table


def placement_toml(variant: str, port: int, box: Path, folder: Path) -> str:
    config: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "port": port, "shutdown_grace_s": 2.0},
        "metrics": {"database": str(folder / "history.sqlite3")},
        "logging": {"level": "info", "format": "json"},
    }
    if variant == "static":
        config["groups"] = {"gpu0": {"memory_mib": 24 * GIB}, "gpu1": {"memory_mib": 24 * GIB}}
    else:
        config["devices"] = {"devices_command": box_command(box), "read_interval_s": 0.5}
    config["slots"] = [slot_table(m, procs.free_port(), box, variant) for m in MODELS]
    return "# generated by bench/placement.py\n" + tomli_w.dumps(config)


async def start_hal0d(procset: procs.Processes, variant: str) -> tuple[procs.Child, Path]:
    """hal0d for `variant` on a fresh box; hal0d's environment names no devices (it would then
    place nothing itself)."""
    name = f"hal0d-placement-{variant}"
    folder = procset.workdir / name
    folder.mkdir(exist_ok=True)
    box = folder / "box.json"
    device.make_box(box, device.TWO_24G_GPUS)
    port = procs.free_port()
    config = folder / "hal0d.toml"
    config.write_text(placement_toml(variant, port, box, folder))
    unset = [arg for var in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
                             "ROCR_VISIBLE_DEVICES") for arg in ("-u", var)]
    hal0d = str(Path(sys.executable).parent / "hal0d")
    child = procset.spawn(name, ["env", *unset, hal0d, "serve", "--config", str(config)], port,
                          cwd=procs.ROOT)
    await procs.wait_until(child, procs.http_ok(child.base + "/readyz"), 30, procset)
    return child, box


# -- the clients --------------------------------------------------------------------------------

def arrivals(seconds: float) -> list[tuple[float, str]]:
    """(time, model), sorted: each model's Poisson arrivals at its share of TOTAL_RATE."""
    rng = random.Random(SEED)
    total = sum(m.weight for m in MODELS)
    found = []
    for model in MODELS:
        rate, t = TOTAL_RATE * model.weight / total, 0.0
        while (t := t + rng.expovariate(rate)) < seconds:
            found.append((t, model.name))
    return sorted(found)


@dataclass(frozen=True)
class Answer:
    model: str
    latency_s: float
    outcome: str  # "answered", or "<status> <code>", "200, then <code>", "no answer", ...
    message: str = ""

    @property
    def answered(self) -> bool:
        return self.outcome == "answered"

    @property
    def out_of_memory(self) -> bool:
        return "out of memory" in self.message.lower()

    @property
    def clear(self) -> bool:
        """Answered, or refused with an error code and a message."""
        return self.answered or (" " in self.outcome and bool(self.message)
                                 and not self.outcome.startswith(("no answer", "200, cut")))


def error_of(raw: bytes) -> dict[str, Any] | None:
    """The `error` object of an OpenAI error body or frame, else None."""
    try:
        parsed = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    error = parsed.get("error") if isinstance(parsed, dict) else None
    return error if isinstance(error, dict) else None


def classify(status: int, body: bytes) -> tuple[str, str]:
    """The outcome and the error's message of a response."""
    if status != 200:
        error = error_of(body) or {}
        return f"{status} {error.get('code') or error.get('type') or '-'}", str(
            error.get("message") or body[:200].decode(errors="replace"))
    for line in body.split(b"\n"):
        if line.startswith(b"data: {") and (frame := error_of(line[6:])) is not None:
            return f"200, then {frame.get('code') or frame.get('type')}", str(
                frame.get("message", ""))
    return ("answered", "") if b"data: [DONE]" in body else ("200, cut", "")


def request_body(model: str) -> bytes:
    return orjson.dumps({"model": model, "stream": True, "max_tokens": TOKENS,
                         "messages": [{"role": "user", "content": "hi"}]})


async def ask(session: aiohttp.ClientSession, base: str, model: str) -> Answer:
    began = time.monotonic()
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT_S), session.post(
                base + client.CHAT, data=request_body(model),
                headers=client.JSON_HEADERS) as resp:
            outcome, message = classify(resp.status, await resp.read())
    except (aiohttp.ClientError, TimeoutError) as exc:
        outcome, message = "no answer", repr(exc)
    return Answer(model, time.monotonic() - began, outcome, message)


async def send_all(session: aiohttp.ClientSession, base: str,
                   planned: list[tuple[float, str]]) -> list[Answer]:
    began = time.monotonic()
    tasks = []
    for at, model in planned:
        await asyncio.sleep(max(0.0, began + at - time.monotonic()))
        tasks.append(asyncio.create_task(ask(session, base, model)))
    return list(await asyncio.gather(*tasks))


async def desktop(box: Path, after_s: float, until_s: float) -> float | None:
    """The desktop takes DESKTOP_MIB on device 0 `after_s` from now, tried again every half
    second while it lacks room: when it got it (seconds from now), None if never by `until_s`."""
    began = time.monotonic()
    await asyncio.sleep(after_s)
    while (now := time.monotonic() - began) < until_s:
        taking = await asyncio.create_subprocess_exec(
            *box_command(box), "--take", str(DESKTOP_MIB), "--device", "0", "--owner",
            "desktop", stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        if await taking.wait() == 0:
            return now
        await asyncio.sleep(0.5)
    return None


# -- what hal0d and the box did -----------------------------------------------------------------

@dataclass
class Samples:
    loading: list[bool] = field(default_factory=list)
    max_used_mib: dict[int, int] = field(default_factory=dict)
    totals_mib: dict[int, int] = field(default_factory=dict)

    def add_box(self, box: device.Box) -> None:
        for dev in box.devices:
            self.totals_mib[dev.index] = dev.total_mib
            used = box.used_mib(dev.index)
            self.max_used_mib[dev.index] = max(self.max_used_mib.get(dev.index, 0), used)


async def sample(session: aiohttp.ClientSession, base: str, box: Path,
                 stop: asyncio.Event) -> Samples:
    """Every SAMPLE_S: whether a slot was starting (/api/slots), and what each device held."""
    samples = Samples()
    while not stop.is_set():
        async with session.get(base + "/api/slots") as resp:
            views = (await resp.json())["slots"]
        samples.loading.append(any(v["state"] == "starting" for v in views))
        samples.add_box(await asyncio.to_thread(device.read_box, box))
        await asyncio.sleep(SAMPLE_S)
    return samples


async def loads_by_outcome(session: aiohttp.ClientSession, base: str) -> dict[str, int]:
    async with session.get(base + "/metrics") as resp:
        text = await resp.text()
    found: dict[str, int] = collections.Counter()
    for line in text.splitlines():
        if line.startswith("hal0d_slot_loads_total{"):
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            found[outcome] += int(float(line.rsplit(" ", 1)[1]))
    return dict(found)


def logged_events(log: Path) -> dict[str, int]:
    """How many of each EVENTS line hal0d logged."""
    found: dict[str, int] = collections.Counter()
    for line in log.read_bytes().splitlines():
        try:
            event = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if (isinstance(event, dict) and event.get("event") in EVENTS
                and event.get("reason") != "shutdown"):
            found[event["event"]] += 1
    return dict(found)


# -- a run --------------------------------------------------------------------------------------

async def run_variant(procset: procs.Processes, variant: str, seconds: float) -> dict[str, Any]:
    hal0d, box = await start_hal0d(procset, variant)
    stop = asyncio.Event()
    try:
        async with client.session() as session:
            sampler = asyncio.create_task(sample(session, hal0d.base, box, stop))
            began = time.monotonic()
            desk = asyncio.create_task(desktop(box, seconds / 2, seconds))
            answers = await send_all(session, hal0d.base, arrivals(seconds))
            wall_s = time.monotonic() - began
            stop.set()
            samples, desktop_at = await sampler, await desk
            loads = await loads_by_outcome(session, hal0d.base)
    finally:
        hal0d.stop()
    return summary(answers, samples, loads=loads, wall_s=wall_s, desktop_at=desktop_at,
                   events=logged_events(procset.workdir / f"{hal0d.name}.log"))


def summary(answers: list[Answer], samples: Samples, *, loads: dict[str, int], wall_s: float,
            desktop_at: float | None, events: dict[str, int]) -> dict[str, Any]:
    answered = [a for a in answers if a.answered]
    latencies = [a.latency_s for a in answered] or [0.0]
    refused = collections.Counter(a.outcome for a in answers if not a.answered)
    by_model = collections.Counter(a.model for a in answers if not a.answered)
    return {
        "requests": len(answers), "answered": len(answered),
        "p50_s": client.median(latencies), "p95_s": client.pct(latencies, 95),
        "refused": dict(refused.most_common()), "refused_by_model": dict(by_model.most_common()),
        "out_of_memory": sum(a.out_of_memory for a in answers),
        "unclear": sum(not a.clear for a in answers),
        "first_messages": {o: next(a.message for a in answers if a.outcome == o)
                           for o in refused},
        "loads": loads, "loading_share": sum(samples.loading) / max(len(samples.loading), 1),
        # JSON's keys are strings: the devices' indexes as "0", "1"
        "max_used_mib": {str(d): mib for d, mib in samples.max_used_mib.items()},
        "totals_mib": {str(d): mib for d, mib in samples.totals_mib.items()},
        "wall_s": wall_s, "desktop_at_s": desktop_at, "events": events,
    }


async def measure(run: Run, procset: procs.Processes, say: Callable[[str], None]) -> None:
    seconds = wall_seconds(run.plan.latency_pairs < 1000)
    results = {}
    for variant in VARIANTS:
        say(f"placement: {variant}, {seconds:g} s of Poisson arrivals over "
            f"{len(MODELS)} models, a desktop at {seconds / 2:g} s")
        results[variant] = await run_variant(procset, variant, seconds)
    run.results["placement"] = {"variants": results, "seconds": seconds}


# -- the rows -----------------------------------------------------------------------------------

def rows(run: Run) -> list[dict[str, Any]]:
    r = run.results.get("placement")
    if not r:
        return []
    out: list[dict[str, Any]] = []
    for variant, s in r["variants"].items():
        out.extend(variant_rows(variant, s))
    return out


def variant_rows(variant: str, s: dict[str, Any]) -> list[dict[str, Any]]:
    def row(name: str, value: str, target: str, ok: bool | None, note: str) -> dict[str, Any]:
        return {"row": f"placement, {variant}: {name}", "value": value, "target": target,
                "verdict": verdict(ok), "note": note}

    loads, events = s["loads"], s["events"]
    devices = sorted(s["totals_mib"], key=int)
    over = [d for d in devices if s["max_used_mib"][d] > s["totals_mib"][d]]
    oom_target = variant == "measured"
    return [
        row("answered or refused with a reason", f"{s['answered']} of {s['requests']} answered",
            "every one answered or refused with a reason", s["unclear"] == 0,
            f"{s['unclear']} without a reason; refused: " + refused_note(s)),
        row("out of memory seen by clients", str(s["out_of_memory"]),
            "0" if oom_target else "-", s["out_of_memory"] == 0 if oom_target else None,
            "responses whose error says out of memory"),
        row("latency, answered", f"p50 {s['p50_s']:.2f} / p95 {s['p95_s']:.2f} s", "-", None,
            f"from sending to the stream's end; {s['wall_s']:.0f} s wall"),
        row("loads", f"{sum(loads.values())} ({loads.get('failed', 0)} failed)", "-", None,
            f"loading {100 * s['loading_share']:.0f}% of the wall time; hal0d's log: "
            + ", ".join(f"{EVENTS[e]} {events.get(e, 0)}" for e in EVENTS)),
        row("device memory, most used", ", ".join(
            f"GPU{d} {s['max_used_mib'][d]}/{s['totals_mib'][d]} MiB" for d in devices),
            "<= total", not over and bool(devices), desktop_note(s["desktop_at_s"])),
    ]


def refused_note(s: dict[str, Any]) -> str:
    if not s["refused"]:
        return "none"
    return "; ".join(f"{n} x {outcome} (first: {first_words(s['first_messages'][outcome])})"
                     for outcome, n in s["refused"].items()) + "; by model " + ", ".join(
        f"{model} {n}" for model, n in s["refused_by_model"].items())


def first_words(message: str) -> str:
    """A refusal's message up to the server's own lines, which hal0d appends after it."""
    return message.split("; process exited", 1)[0][:120]


def desktop_note(at_s: float | None) -> str:
    if at_s is None:
        return f"the desktop never had its {DESKTOP_MIB} MiB on GPU0"
    return f"the desktop took {DESKTOP_MIB} MiB on GPU0 at {at_s:.1f} s"
