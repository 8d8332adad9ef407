"""The `router` rows of `make bench-router`: hal0d against llama.cpp's own router mode, on the
real llama-server, with the same conversations.

Three models (three names for the one SmolLM2 file: smol-a, smol-b, smol-c.gguf in a folder) and
room for one of them, two closed-loop conversations per model (each its own server slot: every
llama-server runs `-c 8192 -np 2 -t 1`), each opening with a long prompt of seeded notes and then
asking a short question a turn (bench/conversations.py). Each system below runs the same workload
for the same wall time, one after the other, each started fresh and stopped (its whole process
group, for the router) before the next:

    alone           one llama-server with smol-a's two conversations: the turns one model gets
                    in that time when it has the machine to itself
    router -np 2    `llama-server --models-dir D --models-max 1 -c 8192 -np 2 -t 1`: the router
                    passes its own arguments to the child it spawns per model
    router -np 1    the same with `-np 1 -c 4096`: one server slot, both conversations in it
    hal0d           three on-demand slots in `[groups.gpu] max_loaded = 1` with nothing else set
                    (the group's defaults), each `prompt_cache = "save"`, max_concurrent 2
    hal0d loaded    the three slots `start = "always"`, no group: no swaps at all, the limit
    hal0d, +10 s    as hal0d, each load 10 s longer (`sh -c "sleep 10; exec llama-server ..."`):
                    the share of time spent swapping when loads are long (/api/slots' group)

What a row counts (router_rows.py): the turns answered within the window, per model and per
conversation; errors (a status other than 200, or an exception); the latency of a turn from
sending it to its answer; and the prompt tokens the servers computed (the sum of llama-server's
`timings.prompt_n`, which hal0d passes through) against the ideal (each conversation's last
full prompt: every token read once).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import tomli_w

from bench import conversations, procs
from bench.conversations import Conversation
from bench.router_rows import summary
from bench.runs import Run

MODELS = ("smol-a", "smol-b", "smol-c")
CONVERSATIONS_PER_MODEL = 2
THREADS = 1
START_S = 300.0  # the most a system may take to start (hal0d's three always slots, say)
LOAD_TIMEOUT_S = 300.0  # hal0d's: generous, so a slow load is measured and not refused
SLOW_LOAD_S = 10.0
SETTLE_S = 2.0  # between systems: the last one's processes gone, the page cache quiet
NEEDS = ("section router needs llama-server and the model: `make bench-router` builds and "
         "fetches them (as `make test-real` does) and passes them, or set HAL0D_REAL_SERVER "
         "and HAL0D_REAL_MODEL")


@dataclass(frozen=True)
class System:
    """One row's way of serving the three models."""

    key: str
    label: str
    kind: str  # "alone", "router" or "hal0d"
    context: int = 8192
    parallel: int = 2
    on_demand: bool = True  # hal0d: slots in the group of one, else always loaded
    load_delay_s: float = 0.0  # hal0d: each load this much longer

    @property
    def models(self) -> tuple[str, ...]:
        return MODELS[:1] if self.kind == "alone" else MODELS

    @property
    def server_args(self) -> list[str]:
        return ["-c", str(self.context), "-np", str(self.parallel), "-t", str(THREADS),
                "--no-webui"]


SYSTEMS = (
    System("alone", "one model alone", "alone"),
    System("router-np2", "llama.cpp router, -np 2", "router"),
    System("router-np1", "llama.cpp router, -np 1 -c 4096", "router", context=4096, parallel=1),
    System("hal0d", "hal0d defaults", "hal0d"),
    System("hal0d-loaded", "hal0d, all loaded", "hal0d", on_demand=False),
    System("hal0d-slow", f"hal0d defaults, loads +{SLOW_LOAD_S:g} s", "hal0d",
           load_delay_s=SLOW_LOAD_S),
)


@dataclass
class RouterPlan:
    seconds: float
    note_words: int  # ~40 tokens fewer than the first prompt (the chat template, the preamble)
    systems: tuple[System, ...] = SYSTEMS

    @classmethod
    def of(cls, seconds: float, note_words: int) -> RouterPlan:
        """The plan, overridden by HAL0D_ROUTER_S, HAL0D_ROUTER_WORDS and HAL0D_ROUTER_SYSTEMS
        (keys, comma-separated: a quick look at a few rows)."""
        keys = [k for k in os.environ.get("HAL0D_ROUTER_SYSTEMS", "").split(",") if k]
        if unknown := set(keys) - {s.key for s in SYSTEMS}:
            raise ValueError(f"HAL0D_ROUTER_SYSTEMS: no system {', '.join(sorted(unknown))} "
                             f"(known: {', '.join(s.key for s in SYSTEMS)})")
        return cls(float(os.environ.get("HAL0D_ROUTER_S", seconds)),
                   int(os.environ.get("HAL0D_ROUTER_WORDS", note_words)),
                   tuple(s for s in SYSTEMS if not keys or s.key in keys))


def problem() -> str | None:
    """Why the section cannot run as asked (no llama-server, a bad override), or None: checked
    before the bench starts anything."""
    real = find_real()
    if isinstance(real, str):
        return real
    try:
        RouterPlan.of(0.0, 0)
    except ValueError as exc:
        return str(exc)
    return None


def find_real() -> tuple[str, str] | str:
    """llama-server's and the model's paths from HAL0D_REAL_SERVER and HAL0D_REAL_MODEL, or why
    the section cannot run."""
    server, model = os.environ.get("HAL0D_REAL_SERVER"), os.environ.get("HAL0D_REAL_MODEL")
    if not server or not model:
        return NEEDS
    if not os.access(server, os.X_OK):
        return f"{NEEDS} (HAL0D_REAL_SERVER={server} is not an executable)"
    if not os.path.isfile(model):
        return f"{NEEDS} (HAL0D_REAL_MODEL={model} is not a file)"
    return server, model


def models_folder(workdir: Path, model: str) -> Path:
    """The router's --models-dir: one link a model name to the one gguf file."""
    folder = workdir / "router-models"
    folder.mkdir(exist_ok=True)
    for name in MODELS:
        link = folder / f"{name}.gguf"
        if not link.exists():
            link.symlink_to(model)
    return folder


# -- starting each kind of system -------------------------------------------------------------

Ready = Callable[[aiohttp.ClientSession], object]


def start_alone(procset: procs.Processes, server: str, folder: Path,
                system: System) -> tuple[procs.Child, Ready]:
    port = procs.free_port()
    argv = [server, "-m", str(folder / f"{MODELS[0]}.gguf"), "--alias", MODELS[0],
            "--host", "127.0.0.1", "--port", str(port), *system.server_args]
    child = procset.spawn(f"router-{system.key}", argv, port, group=True)
    return child, procs.http_ok(child.base + "/health")


def start_router(procset: procs.Processes, server: str, folder: Path,
                 system: System) -> tuple[procs.Child, Ready]:
    """Router mode: no model of its own, the folder's files as models (named by their file
    names without .gguf), at most one loaded; the arguments after the router's own are passed
    to every child it spawns. Its children share its process group: stopped with it."""
    port = procs.free_port()
    argv = [server, "--models-dir", str(folder), "--models-max", "1", "--host", "127.0.0.1",
            "--port", str(port), *system.server_args]
    child = procset.spawn(f"router-{system.key}", argv, port, group=True)
    return child, procs.http_ok(child.base + "/v1/models")


def hal0d_slot(server: str, folder: Path, model: str, system: System) -> dict[str, Any]:
    port = procs.free_port()
    command = [server, "-m", str(folder / f"{model}.gguf"), "--alias", model,
               "--host", "127.0.0.1", "--port", str(port), *system.server_args,
               "--slot-save-path", "{prompt_cache_dir}"]
    if system.load_delay_s:
        # exec: the sleep's shell becomes llama-server, so hal0d's stop reaches it
        command = ["sh", "-c", f"sleep {system.load_delay_s:g}; exec {shlex.join(command)}"]
    slot: dict[str, Any] = {
        "name": model, "upstream": f"http://127.0.0.1:{port}", "models": [model],
        "command": command, "start": "on_demand" if system.on_demand else "always",
        "max_concurrent": CONVERSATIONS_PER_MODEL, "prompt_cache": "save",
        "load_timeout_s": LOAD_TIMEOUT_S + system.load_delay_s,
    }
    if system.on_demand:
        slot["group"] = "gpu"
    return slot


def start_hal0d(procset: procs.Processes, server: str, folder: Path,
                system: System) -> tuple[procs.Child, Ready]:
    port = procs.free_port()
    name = f"router-{system.key}"
    state = procset.workdir / name
    state.mkdir(exist_ok=True)
    config: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "port": port, "shutdown_grace_s": 5.0},
        "metrics": {"database": str(state / "history.sqlite3")},
        "logging": {"level": "info", "format": "json"},
    }
    if system.on_demand:
        config["groups"] = {"gpu": {"max_loaded": 1}}  # and nothing else: the defaults
    config["slots"] = [hal0d_slot(server, folder, m, system) for m in system.models]
    path = state / "hal0d.toml"
    path.write_text(f"# generated by bench/router.py for {system.label}\n"
                    + tomli_w.dumps(config))
    child = procset.spawn(name, [str(Path(sys.executable).parent / "hal0d"), "serve",
                                 "--config", str(path)], port, cwd=procs.ROOT)
    if system.on_demand:
        return child, procs.http_ok(child.base + "/readyz")
    return child, procs.slots_ready(child.base)


STARTERS = {"alone": start_alone, "router": start_router, "hal0d": start_hal0d}


# -- what each system leaves to read ----------------------------------------------------------

async def hal0d_groups(base: str) -> list[dict[str, Any]]:
    """/api/slots' groups at the end of the run: swaps, swap_cost_s, swap_share (and turn_s
    where this tree's hal0d has it)."""
    async with aiohttp.ClientSession() as session, session.get(base + "/api/slots") as resp:
        return list((await resp.json()).get("groups") or [])


def log_lines(path: Path) -> list[bytes]:
    with contextlib.suppress(OSError):
        return path.read_bytes().splitlines()
    return []


def log_events(path: Path) -> list[dict[str, Any]]:
    """hal0d's JSON log lines (its slots' processes' own output lines are logged as events
    too; anything else, a traceback say, is skipped)."""
    found = []
    for line in log_lines(path):
        with contextlib.suppress(orjson.JSONDecodeError):
            event = orjson.loads(line)
            if isinstance(event, dict):
                found.append(event)
    return found


def started_pids(log: Path) -> list[int]:
    return [int(e["pid"]) for e in log_events(log)
            if e.get("event") == "slot.process_started" and isinstance(e.get("pid"), int)]


def error_events(log: Path) -> list[str]:
    """hal0d's error lines (a failed load, a failed save), by event name."""
    return [str(e.get("event")) for e in log_events(log)
            if e.get("level") in ("error", "critical")]


def loads_of(system: System, log: Path) -> int:
    """Model processes started: the router's spawns, hal0d's slot processes, alone's one."""
    if system.kind == "router":
        return sum(b"spawning server instance with name=" in line for line in log_lines(log))
    if system.kind == "hal0d":
        return len(started_pids(log))
    return 1


def reap_hal0d_children(log: Path, folder: Path, say: Callable[[str], None]) -> None:
    """A llama-server that outlived its hal0d (hal0d killed before it stopped them) ends by
    its own process group, which hal0d gives each; only ours: its command names our folder."""
    for pid in started_pids(log):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                if str(folder).encode() not in cmdline.read():
                    continue  # another process's pid now
        except OSError:
            continue  # gone
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
            say(f"router: llama-server {pid} outlived its hal0d; killed its group")


# -- the section ------------------------------------------------------------------------------

def conversations_for(system: System, plan: RouterPlan) -> list[Conversation]:
    """The same conversations (names, seeds) for every system that serves their model."""
    per_slot = system.context // system.parallel
    return [Conversation(f"{model}-{k + 1}", model, seed=100 * i + k,
                         note_words=plan.note_words, context=per_slot)
            for i, model in enumerate(MODELS) if model in system.models
            for k in range(CONVERSATIONS_PER_MODEL)]


async def run_system(procset: procs.Processes, real: tuple[str, str], folder: Path,
                     system: System, plan: RouterPlan) -> dict[str, Any]:
    child, ready = STARTERS[system.kind](procset, real[0], folder, system)
    talks = conversations_for(system, plan)
    groups: list[dict[str, Any]] = []
    try:
        await procs.wait_until(child, ready, START_S, procset)
        wall_s = await conversations.closed_loop(child.base, talks, plan.seconds)
        if system.kind == "hal0d":
            groups = await hal0d_groups(child.base)
    finally:
        child.stop()
        procset.children.remove(child)
    log = procset.workdir / f"{child.name}.log"
    return {"label": system.label, "kind": system.kind, "wall_s": wall_s,
            "seconds": plan.seconds, "loads": loads_of(system, log), "groups": groups,
            "log_errors": error_events(log) if system.kind == "hal0d" else [],
            "talks": talks}


async def measure(run: Run, procset: procs.Processes, say: Callable[[str], None]) -> None:
    real = find_real()
    if isinstance(real, str):
        raise RuntimeError(real)
    plan = RouterPlan.of(run.plan.router_s, run.plan.router_note_words)
    folder = models_folder(procset.workdir, real[1])
    results: dict[str, Any] = {"seconds": plan.seconds, "note_words": plan.note_words,
                               "systems": {}}
    run.results["router"] = results
    for system in plan.systems:
        say(f"router: {system.label}, {plan.seconds:g} s")
        try:
            figures = await run_system(procset, real, folder, system, plan)
        except RuntimeError as exc:
            results["systems"][system.key] = {"label": system.label, "failed": str(exc)}
            say(f"router: {system.label} failed: {exc}")
            continue
        finally:
            reap_hal0d_children(procset.workdir / f"router-{system.key}.log", folder, say)
        results["systems"][system.key] = summary(figures)
        await asyncio.sleep(SETTLE_S)
