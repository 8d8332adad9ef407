"""`python -m hal0d_stub.devices FILE`: the simulated GPU box (device.py) as hal0d's
`[devices] devices_command` reads a machine's GPUs, and the verbs a test or the benchmark scripts
a box with.

    python -m hal0d_stub.devices FILE                   print the box (below)
    python -m hal0d_stub.devices FILE --make 24576,24576
                                                        a new box: one device per total, in MiB
    python -m hal0d_stub.devices FILE --take 2048 --device 1 --owner desktop
                                                        memory taken by what is no model server
                                                        (a desktop, a game): all or nothing;
                                                        exit 1 when it does not fit
    python -m hal0d_stub.devices FILE --release desktop everything that owner took

The box printed, as devices_command's JSON (used_mib: every living allocation of the device; one
entry in processes per pid; an owner's memory, a desktop's, is in used_mib and in no process,
as a driver shows memory it tells no process of, and as hal0d reads pid 0: no process):

    {"devices": [{"index": 0, "name": "sim-24G", "total_mib": 24576, "used_mib": 1200,
                  "processes": [{"pid": 123, "used_mib": 900}]}]}
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from hal0d_stub import device


def as_devices_command(box: device.Box) -> dict[str, Any]:
    listed = []
    for dev in box.devices:
        by_pid: dict[int, int] = {}
        for allocation in box.allocations:
            if allocation.device == dev.index and allocation.pid != device.NO_PROCESS:
                by_pid[allocation.pid] = by_pid.get(allocation.pid, 0) + allocation.mib
        listed.append({"index": dev.index, "name": dev.name, "total_mib": dev.total_mib,
                       "used_mib": box.used_mib(dev.index),
                       "processes": [{"pid": pid, "used_mib": mib}
                                     for pid, mib in by_pid.items()]})
    return {"devices": listed}


def mib_list(text: str) -> list[int]:
    try:
        totals = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"MiB per device, comma-separated: {text!r}") from None
    if any(total <= 0 for total in totals):
        raise argparse.ArgumentTypeError(f"each device needs some MiB: {text!r}")
    return totals


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m hal0d_stub.devices",
        description="print the simulated GPU box as hal0d's devices_command, or change it")
    parser.add_argument("state", type=Path, metavar="FILE", help="the box's state file")
    verb = parser.add_mutually_exclusive_group()
    verb.add_argument("--make", type=mib_list, metavar="MIB,MIB,...",
                      help="make a new box, one device per total (replaces FILE)")
    verb.add_argument("--take", type=int, metavar="MIB",
                      help="take MIB on --device for --owner, as a desktop or a game does")
    verb.add_argument("--release", metavar="NAME", help="release all that owner NAME took")
    parser.add_argument("--device", type=int, default=0, help="the device of --take (default 0)")
    parser.add_argument("--owner", default="desktop",
                        help="who --take takes for (default desktop)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.make is not None:
            device.make_box(args.state, args.make)
        elif args.take is not None:
            shortfall = device.allocate(args.state, device.NO_PROCESS, {args.device: args.take},
                                        owner=args.owner)
            if shortfall is not None:
                print(f"{args.owner} cannot take {args.take} MiB on device {args.device}: "
                      f"{shortfall[args.device]} MiB short", file=sys.stderr)
                return 1
        elif args.release is not None:
            device.release(args.state, owner=args.release)
        else:
            print(json.dumps(as_devices_command(device.read_box(args.state))))
    except (OSError, ValueError) as exc:
        print(f"hal0d_stub.devices: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
