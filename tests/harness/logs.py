"""hal0d's logs as a test reads them: its own pipeline pointed at a buffer, and the watch for the
lines only a bug of hal0d's writes (conftest's `hal0d_logged_no_bug` fails a test on one)."""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import structlog

from hal0d import logs


@contextlib.contextmanager
def logs_into_buffer(fmt: str, level: str) -> Iterator[io.StringIO]:
    """hal0d's real logging pipeline (logs.configure, aiohttp's loggers included) into a buffer;
    structlog's configuration and the standard library's logging restored afterwards."""
    # The processors as a list of their own: configure() changes its chain in place.
    saved = {**structlog.get_config(), "processors": list(structlog.get_config()["processors"])}
    root = logging.getLogger()
    saved_root = (root.handlers[:], root.level)
    access = logging.getLogger("aiohttp.access")
    saved_access = access.disabled
    buffer = io.StringIO()
    logs.configure(level=level, fmt=fmt, stream=buffer)
    for watch in _watches:  # its wrapper class is hal0d's now: the watch reads the buffer
        watch.buffers.append(buffer)
    try:
        yield buffer
    finally:
        structlog.configure(**saved)
        root.handlers[:], _ = saved_root
        root.setLevel(saved_root[1])
        access.disabled = saved_access


# -- lines only a bug writes -----------------------------------------------------------------

# What hal0d logs only when it has a bug: a task of the lifecycle manager raised.
BUG_EVENTS = ("lifecycle.task_failed",)


class BugWatch:
    """The lines of BUG_EVENTS one test's daemons logged: in process, each event as structlog
    is asked to log it, before any processor (so neither a test's capture_logs nor a level
    hides one); of a `hal0d serve` (or hal0d's pipeline into a buffer), the lines of its log
    that name one, read when asked."""

    def __init__(self, events: tuple[str, ...]) -> None:
        self.events = events
        self.logged: list[str] = []
        self.logs: list[Path] = []
        self.buffers: list[io.StringIO] = []

    def seen(self, event: str, fields: dict[str, Any]) -> None:
        told = " ".join(f"{key}={value!r}" for key, value in fields.items()
                        if key != "exc_info")
        self.logged.append(f"in process: {event} {told}")

    def found(self) -> list[str]:
        lines = list(self.logged)
        for path in self.logs:
            text = path.read_text(errors="replace") if path.exists() else ""
            lines += [f"{path}: {line}" for line in text.splitlines() if self._names_one(line)]
        for buffer in self.buffers:
            lines += [f"logs_into_buffer: {line}" for line in buffer.getvalue().splitlines()
                      if self._names_one(line)]
        return lines

    def _names_one(self, line: str) -> bool:
        return any(event in line for event in self.events)


_watches: list[BugWatch] = []


def watch_log(path: Path) -> None:
    """A daemon's log file, read for BUG_EVENTS when the test ends."""
    for watch in _watches:
        watch.logs.append(path)


def _observing(base: type[Any], watch: BugWatch) -> type[Any]:
    """structlog's wrapper class `base`, telling `watch` of each of its events first."""

    class Observed(base):
        def _process_event(self, method_name: str, event: str | None,
                           event_kw: dict[str, Any]) -> Any:
            if event in watch.events:
                watch.seen(event, {**self._context, **event_kw})
            return super()._process_event(method_name, event, event_kw)

    return Observed


@contextlib.contextmanager
def watching_for_bugs(events: tuple[str, ...] = BUG_EVENTS) -> Iterator[BugWatch]:
    """What hal0d logs of `events` until the block ends: in process through structlog's
    wrapper class (what capture_logs leaves alone), and in the logs of the daemons the harness
    starts meanwhile."""
    watch = BugWatch(events)
    wrapper = structlog.get_config()["wrapper_class"]
    structlog.configure(wrapper_class=_observing(wrapper, watch))
    _watches.append(watch)
    try:
        yield watch
    finally:
        _watches.remove(watch)
        structlog.configure(wrapper_class=wrapper)
