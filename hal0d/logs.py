"""The one logging pipeline: structlog events, one line each, for people, journald or shippers.

Event names are `noun.verb` (`request.done`, `slot.state_changed`). Under journald (JOURNAL_STREAM
names our stdout) each line starts with its `<N>` syslog priority and carries no timestamp of its
own, so `journalctl -p warning` filters and nothing is printed twice. Standard-library loggers
(aiohttp's) run through the same processors. Secrets are redacted as the last step before a
renderer, after tracebacks are formatted: by key (`authorization`, `api_key`...), by shape
(`Bearer ...`, `sk-...`, `x-api-key: ...` inside any text) and by value (the slots' own keys,
registered with `hide`).

`hal0d serve` caches each logger on its first use (structlog's faster way). The level and the
format live in the one processor chain, changed in place, so a reload's new ones reach the
cached loggers too.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Iterable, MutableMapping
from typing import Any, TextIO

import orjson
import structlog
from structlog.processors import NAME_TO_LEVEL

# Keys whose values are credentials wherever they appear in an event.
SECRET_KEYS = frozenset(
    {"authorization", "api_key", "x-api-key", "x_api_key", "api_keys", "password", "token",
     "proxy-authorization", "cookie"}
)
REDACTED = "[redacted]"
_PRIORITY = {"critical": 2, "error": 3, "exception": 3, "warning": 4, "warn": 4, "info": 6,
             "debug": 7, "notset": 7}
# Credentials by their shape, inside free text (a message, a traceback, a repr of headers).
_SECRET_SHAPES = (
    (re.compile(r"(?i)\b(bearer)(\s+)[A-Za-z0-9._~+/=-]{4,}"), rf"\1\2{REDACTED}"),
    (re.compile(r"\b(Basic)(\s+)[A-Za-z0-9+/=]{8,}"), rf"\1\2{REDACTED}"),
    (
        re.compile(
            r"(?i)\b((?:x-)?api[-_]?key|(?:proxy-)?authorization|password|secret|token)"
            r"""(['"]?\s*[:=]\s*['"]?)(?!\[redacted\])(?!bearer\b|basic\b)[^\s'",;&}]+"""
        ),
        rf"\1\2{REDACTED}",
    ),
    (re.compile(r"\bsk-[A-Za-z0-9_-]{8,}"), REDACTED),
)
# Words one of which every shape above needs (case-folded, as the shapes' (?i) matches): most
# log text has none of them, and request.done checks every string of every request. Plain
# substring tests of the case-folded text: a case-insensitive regex alternation over the same
# words costs ~8 us for request.done's strings, these ~0.6 us.
_SECRET_HINTS = ("bearer", "basic", "api", "authorization", "password", "secret", "token", "sk-")
# Exact secret values hal0d itself knows (the slots' upstream keys), see hide().
# Replaced whole, never changed in place: a thread logging during a reload (the history writer)
# iterates the set it read, not one that changes under it.
_hidden: frozenset[str] = frozenset()
_MIN_HIDDEN_LEN = 6  # shorter values would redact ordinary words


def hide(values: Iterable[str]) -> None:
    """Never log these exact strings (the secrets of the configuration now in force): they
    replace the ones given before, so a reload does not make every string ever hidden cost
    a search in every log line."""
    global _hidden  # noqa: PLW0603 (one process-wide set, replaced atomically)
    _hidden = frozenset(value for value in values if len(value) >= _MIN_HIDDEN_LEN)


def _hinted(text: str) -> bool:
    """Whether `text` has a word one of the shapes needs; False: no shape can match it."""
    folded = text.casefold()
    for word in _SECRET_HINTS:  # noqa: SIM110 (a loop: any() and its generator cost more)
        if word in folded:
            return True
    return False


def _suspect(text: str) -> bool:
    """Whether `text` may hold a secret: one of the hidden values, or a hint word.
    False means scrub() would leave it as it is."""
    for value in _hidden:
        if value in text:
            return True
    return _hinted(text)


def scrub(text: str) -> str:
    for value in _hidden:
        if value in text:
            text = text.replace(value, REDACTED)
    if _hinted(text):
        for pattern, replacement in _SECRET_SHAPES:
            text = pattern.sub(replacement, text)
    return text


def _scrub_value(value: Any, depth: int = 0) -> Any:
    if isinstance(value, str):
        return scrub(value)
    if depth > 2:
        return value
    if isinstance(value, dict):
        return {
            k: REDACTED if isinstance(k, str) and k.lower() in SECRET_KEYS
            else _scrub_value(v, depth + 1)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return type(value)(_scrub_value(v, depth + 1) for v in value)
    return value


# Keys known to hold no credential by name: the lower-casing and set lookup is done once per key
# name, not once per key of every event (request.done alone has twenty). Key names come from
# hal0d's and its libraries' code, a bounded set; the bound is a guard all the same.
_PLAIN_KEYS: set[str] = set()
_MAX_PLAIN_KEYS = 4096
_SCALARS = (int, float, bool, type(None))


def redact_secrets(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Credentials out of an event: by key, and by shape or value in any string it holds.

    Most events hold none, so the strings are checked in one pass first (one hint search over
    them all, which any match in one of them also matches); only an event that may hold one
    pays for the per-field substitutions.
    """
    strings: list[str] = []
    for key, value in event.items():
        if key not in _PLAIN_KEYS:
            if key.lower() in SECRET_KEYS:
                event[key] = REDACTED
                continue
            # Not structlog's own bookkeeping (_record, _from_structlog), never scrubbed.
            if not key.startswith("_") and len(_PLAIN_KEYS) < _MAX_PLAIN_KEYS:
                _PLAIN_KEYS.add(key)
        if type(value) is str:
            strings.append(value)
        elif not isinstance(value, _SCALARS) and not key.startswith("_"):
            event[key] = _scrub_value(value)
    if strings and _suspect("\n".join(strings)):
        for key, value in event.items():
            if type(value) is str and not key.startswith("_"):
                event[key] = scrub(value)
    return event


# What makes a logfmt value need its quotes: one search in C, where a test per character in
# Python cost ~10 us of request.done's twenty fields.
_NEEDS_QUOTES = re.compile(r'[ "=\n\t\\]')


def _logfmt_value(value: Any) -> str:
    text = value if type(value) is str else str(value)
    if text and _NEEDS_QUOTES.search(text) is None:
        return text
    return orjson.dumps(text).decode()


class LineRenderer:
    """`event key=value ...` on one line; with journald, prefixed by `<N>` and no timestamp."""

    def __init__(self, journald: bool) -> None:
        self.journald = journald

    def __call__(self, _: Any, method: str, event: MutableMapping[str, Any]) -> str:
        level = str(event.pop("level", method))
        name = str(event.pop("event", ""))
        stamp = event.pop("timestamp", None)
        exc = event.pop("exception", None)
        fields = " ".join(f"{k}={_logfmt_value(v)}" for k, v in event.items())
        line = f"{name} {fields}" if fields else name
        if exc:
            line += " exception=" + _logfmt_value(exc)
        if self.journald:
            return f"<{_PRIORITY.get(level, 6)}>{line}"
        return f"{stamp} [{level}] {line}" if stamp else f"[{level}] {line}"


def under_journald(stream: TextIO) -> bool:
    """True when `stream` is the journal socket systemd handed us (JOURNAL_STREAM=dev:inode)."""
    value = os.environ.get("JOURNAL_STREAM", "")
    try:
        device, inode = (int(part) for part in value.split(":"))
        stat = os.fstat(stream.fileno())
    except (ValueError, OSError):
        return False
    return (stat.st_dev, stat.st_ino) == (device, inode)


def choose_renderer(fmt: str, stream: TextIO) -> Any:
    if fmt == "auto":
        if under_journald(stream):
            fmt = "journald"
        elif stream.isatty():
            fmt = "console"
        else:
            fmt = "logfmt"
    if fmt == "json":
        return structlog.processors.JSONRenderer(serializer=lambda obj, **_: orjson.dumps(
            obj, default=str).decode())
    if fmt == "console":
        return structlog.dev.ConsoleRenderer(colors=True)
    return LineRenderer(journald=fmt == "journald")


# The processor chain, one list for the process's life: configure() changes it in place, so a
# logger cached on its first use keeps following it (structlog's capture_logs changes the
# configured list in place for the same reason).
_CHAIN: list[Any] = []


def _below(threshold: int) -> Any:
    """The chain's first step: events under `threshold` dropped. A step of the chain rather than
    structlog's filtering logger class, which a cached logger would keep after a reload."""

    def drop_below(_: Any, method: str, event: MutableMapping[str, Any]) -> Any:
        if NAME_TO_LEVEL.get(method, logging.INFO) < threshold:
            raise structlog.DropEvent
        return event

    return drop_below


def configure(level: str = "info", fmt: str = "auto", stream: TextIO | None = None, *,
              cache_loggers: bool = False) -> None:
    """Set the pipeline up, or change it (a reload). `cache_loggers`: assemble each logger once,
    on its first use (`hal0d serve`); the tests leave it off, since they point the pipeline at a
    new stream each time and then restore what they found, which a cached logger would miss."""
    stream = stream or sys.stdout
    renderer = choose_renderer(fmt, stream)
    journald = isinstance(renderer, LineRenderer) and renderer.journald
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
    ]
    if not journald:  # the journal stamps each line itself
        shared.append(structlog.processors.TimeStamper(fmt="iso", utc=True))
    # Last before the renderer: a formatted traceback is text that may quote a header.
    shared += [structlog.processors.format_exc_info, redact_secrets]
    numeric = getattr(logging, level.upper(), logging.INFO)
    _CHAIN[:] = [_below(numeric), *shared, renderer]
    structlog.configure(
        processors=_CHAIN,
        wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
        logger_factory=structlog.WriteLoggerFactory(stream),
        cache_logger_on_first_use=cache_loggers,
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processor=renderer,
            foreign_pre_chain=[
                structlog.stdlib.add_logger_name, structlog.stdlib.ExtraAdder(), *shared
            ],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)
    # aiohttp's access log is replaced by our own request.done line.
    logging.getLogger("aiohttp.access").disabled = True


def get_logger(**bound: Any) -> Any:
    return structlog.get_logger(**bound)
