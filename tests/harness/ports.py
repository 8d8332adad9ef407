"""Loopback ports for the daemons and upstreams a test starts."""

from __future__ import annotations

import os

from hal0d.config.ports import unused_port

_handed_out: set[int] = set()


def _this_workers_share() -> tuple[int, int]:
    """(count, index) of pytest-xdist's workers; (1, 0) in a run without them. Each worker takes
    only the ports whose remainder by the count is its index, so two workers never hand out the
    same port, however close together they ask."""
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")  # gw0, gw1, ...
    return count, int(worker.removeprefix("gw") or 0) % count


def free_port() -> int:
    """A loopback port nothing listens on (bound, then released), and none this test run has
    handed out before: two calls before either port is bound (hal0d's and its slot's) could
    otherwise get the same one, and the slot's process would find hal0d on its port."""
    count, index = _this_workers_share()
    while True:
        port = unused_port()
        if port % count == index and port not in _handed_out:
            _handed_out.add(port)
            return port
