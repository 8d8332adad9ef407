"""hal0d's own logging pipeline, pointed at a buffer a test reads."""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Iterator

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
    try:
        yield buffer
    finally:
        structlog.configure(**saved)
        root.handlers[:], _ = saved_root
        root.setLevel(saved_root[1])
        access.disabled = saved_access
