"""hal0d with its metrics path switched off, for the "metrics on vs off" rows.

hal0d has no configuration key for this yet, so this launcher patches it in-process before
running the ordinary command line: the relay gets no StreamTap (no per-chunk metrics work) and
the recorder drops every request (no history row, no Prometheus update). Nothing under hal0d/
is changed on disk.

`--uvloop` runs hal0d on uvloop's event loop instead (uvloop from bench/.peers/uvloop, or
installed): an experiment, for the proposal to make it hal0d's loop.

Run: python -m bench.variant [--no-metrics] [--uvloop] serve --config FILE
"""

from __future__ import annotations

import sys
from typing import Any

from bench.procs import raise_nofile


def disable_metrics() -> None:
    import hal0d.handlers.anthropic as anthropic_handler
    import hal0d.handlers.openai as openai_handler
    from hal0d.metrics.recorder import Recorder
    from hal0d.relay import relay

    async def relay_without_tap(upstream: Any, response: Any, transform: Any, guard: Any,
                                tap: Any = None) -> Any:
        return await relay(upstream, response, transform, guard, None)

    def record_nothing(self: Recorder, info: Any) -> None:
        return None

    openai_handler.relay = relay_without_tap
    anthropic_handler.relay = relay_without_tap
    Recorder.record = record_nothing  # type: ignore[method-assign]


def use_uvloop() -> None:
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent / ".peers" / "uvloop"))
    import uvloop  # type: ignore[import-not-found, unused-ignore]

    uvloop.install()


def main() -> int:
    argv = sys.argv[1:]
    while argv and argv[0].startswith("--"):
        flag = argv.pop(0)
        if flag == "--no-metrics":
            disable_metrics()
        elif flag == "--uvloop":
            use_uvloop()
        else:
            print(f"unknown flag {flag}", file=sys.stderr)
            return 2
    raise_nofile()
    from hal0d.cli import main as hal0d_main

    return hal0d_main(argv)


if __name__ == "__main__":
    sys.exit(main())
