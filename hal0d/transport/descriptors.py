"""File descriptors: the process's open-files limit, and what hal0d does when it runs out.

Every relayed stream holds two sockets (the client's and the upstream's), so the soft limit a
service manager starts hal0d with (systemd: 1024) caps it at about 500 streams. At start hal0d
raises its soft limit to the hard one (`raise_open_files_limit`): hal0d never uses select(2), the
one interface that breaks above descriptor 1023.

When descriptors run out anyway (EMFILE: this process's limit; ENFILE: the system's), a socket
hal0d opens on a request's behalf fails; that request gets FdExhausted (503, Retry-After), and the
log says so once per burst, not once per request: the first refusal is logged at once, later
ones are counted and logged at most every REPORT_EVERY_S while they go on, with how many were
refused since the line before. The accept side is libuv's: when accept(2) fails with EMFILE it
closes a descriptor it keeps in reserve, accepts every pending connection and closes it at once,
then takes the reserve back; such a client sees its connection closed with no answer, and hal0d
neither spins on the listening socket nor stops listening.
"""

from __future__ import annotations

import asyncio
import contextvars
import errno
import os
import resource

from hal0d.errors import FdExhausted
from hal0d.logs import get_logger

log = get_logger()
EXHAUSTION_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE})
REPORT_EVERY_S = 5.0
RETRY_AFTER_S = 2.0  # streams end and give their descriptors back within seconds
NR_OPEN = "/proc/sys/fs/nr_open"


# The soft limit hal0d was started with, once it raised its own; its children get it back.
_started_with: int | None = None


def raise_open_files_limit() -> tuple[int, int, int] | None:
    """Soft RLIMIT_NOFILE up to the hard limit: (old soft, new soft, hard), or None when the
    soft limit already was the hard one (or the kernel refused)."""
    global _started_with  # noqa: PLW0603 (a fact about this process, set once at start)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        # Linux refuses an infinite descriptor limit; its ceiling is fs.nr_open.
        try:
            with open(NR_OPEN) as ceiling:
                target = int(ceiling.read())
        except (OSError, ValueError):
            return None
    if soft != resource.RLIM_INFINITY and soft >= target:
        return None
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (OSError, ValueError) as exc:
        log.warning("server.fd_limit_unchanged", soft=soft, hard=hard, error=str(exc))
        return None
    _started_with = soft
    return soft, target, hard


def limit_for_children() -> tuple[int, int] | None:
    """The open-files limit a slot process should start with: hal0d's own before it raised it
    (systemd's advice: a program that needs more raises its own; one built on select(2) breaks
    above 1024), or None when hal0d did not raise it and children inherit it as it is."""
    if _started_with is None:
        return None
    return _started_with, resource.getrlimit(resource.RLIMIT_NOFILE)[1]


def open_files_limit() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def open_descriptors() -> int:
    """How many descriptors this process holds. Listing /proc/self/fd takes one itself, which
    an exhausted process does not have: then every one below the limit is taken (that is what
    EMFILE means), and the limit is the count."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # minus the listing's own
    except OSError:
        return open_files_limit()


def exhaustion_errno(exc: BaseException) -> int | None:
    """EMFILE or ENFILE when that is what `exc` is, or the OSError it wraps (aiohttp keeps it
    as `os_error` or as the cause); None otherwise."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in EXHAUSTION_ERRNOS:
            return current.errno
        wrapped = getattr(current, "os_error", None)
        current = wrapped if isinstance(wrapped, BaseException) else current.__cause__
    return None


class ExhaustionReport:
    """Counts refusals and logs `server.fd_exhausted` once per REPORT_EVERY_S at most."""

    def __init__(self, every_s: float = REPORT_EVERY_S) -> None:
        self.every_s = every_s
        self.refused_total = 0
        self._pending: dict[str, int] = {}  # refused since the last line, by where
        self._window: asyncio.TimerHandle | None = None

    def refused(self, where: str) -> None:
        self.refused_total += 1
        self._pending[where] = self._pending.get(where, 0) + 1
        if self._window is None:
            self._log()

    def _log(self) -> None:
        log.error(
            "server.fd_exhausted",
            limit=open_files_limit(),
            open=open_descriptors(),
            refused=sum(self._pending.values()),
            refused_total=self.refused_total,
            where=",".join(sorted(self._pending)),
            hint="raise the hard open-files limit (systemd: LimitNOFILE=), or lower "
                 "max_concurrent",
        )
        self._pending.clear()
        # A context of its own: the follow-up line is about the burst, not about the request
        # whose refusal opened the window (its request_id is bound in this one).
        self._window = asyncio.get_running_loop().call_later(
            self.every_s, self._close, context=contextvars.Context()
        )

    def _close(self) -> None:
        self._window = None
        if self._pending:
            self._log()  # the burst went on: one more line, and a new window


# The descriptor table is the process's, so its report is too.
report = ExhaustionReport()


def exhausted(code: int, where: str, what: str) -> FdExhausted:
    """Note one refusal (`code`: EMFILE or ENFILE) and build the client's 503 for it."""
    report.refused(where)
    return FdExhausted(
        f"hal0d has no file descriptor free to {what} ({os.strerror(code)}); "
        "try again shortly",
        retry_after=RETRY_AFTER_S,
    )
