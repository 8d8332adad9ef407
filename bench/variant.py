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


class VariantNotApplied(RuntimeError):
    """The patch found nothing to patch: running on would measure the default as the variant."""


def patch_callers(original: Any, replacement: Any) -> list[str]:
    """Replace `original` in every hal0d module that imported it by name; return their names.

    Patching the module that defines a function misses the modules that did `from ... import`
    it; looking up who holds it keeps the variant true when the code moves (this is how the
    "metrics off" rows once ran the tap without anyone noticing).
    """
    import hal0d.app  # noqa: F401  (imports every handler, so every caller is loaded)

    attribute: str = original.__name__
    patched = []
    for name, module in list(sys.modules.items()):
        if not name.startswith("hal0d") or name == original.__module__:
            continue
        if getattr(module, attribute, None) is original:
            setattr(module, attribute, replacement)
            patched.append(name)
    if not patched:
        raise VariantNotApplied(
            f"no hal0d module calls {original.__module__}.{original.__name__} by that name"
        )
    return patched


def disable_metrics() -> list[str]:
    from hal0d.observability.recorder import Recorder
    from hal0d.transport.relay import relay

    async def relay_without_tap(upstream: Any, response: Any, transform: Any, guard: Any,
                                tap: Any = None, **options: Any) -> Any:
        return await relay(upstream, response, transform, guard, None, **options)

    # Whatever record() is handed: a signature that no longer matches would raise in every
    # request's finish, whose logged traceback then cost more than the metrics path saves.
    def record_nothing(self: Recorder, *_: Any) -> None:
        return None

    patched = patch_callers(relay, relay_without_tap)
    Recorder.record = record_nothing  # type: ignore[method-assign]
    return patched


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
            try:
                patched = disable_metrics()
            except VariantNotApplied as exc:
                print(f"bench.variant: --no-metrics could not be applied: {exc}", file=sys.stderr)
                return 3
            print(f"bench.variant: metrics off (relay without tap in {', '.join(patched)}; "
                  "recorder drops every request)", file=sys.stderr)
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
