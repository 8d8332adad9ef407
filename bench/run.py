"""`make bench` / `make bench-peers`: run every measurement side by side, print one table.

    python -m bench [--peers] [--quick] [--profile] [--out bench/results/latest.json]

The upstream, hal0d (as shipped, plus a stall-guard-off and a metrics-off instance), nginx and
LiteLLM (with --peers) run as separate processes on free loopback ports; this process is the
client. See bench/README.md for what each row means.

This module is the driver: it reads the arguments, starts the processes every section shares,
runs the sections asked for in turn, then prints the table and writes it, with every raw figure,
to --out. The overhead sections are in bench/overhead.py, each other section in its own module,
the table and its rows in bench/table.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from bench import (
    context,
    failover,
    keepalive,
    lifecycle,
    placement,
    procs,
    router,
    shares,
    swaps,
    warm,
)
from bench.overhead import (
    anthropic_section,
    latency_section,
    memory_section,
    paced_section,
    throughput_section,
)
from bench.profiling import profile_section
from bench.runs import BASELINE, FLOOR, RESULTS, Plan, Run, say
from bench.table import baseline_rows, build_rows, render


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
