"""Loopback ports for the daemons and upstreams a test starts."""

from __future__ import annotations

from hal0d.config.ports import unused_port

_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback port nothing listens on (bound, then released), and none this test run has
    handed out before: two calls before either port is bound (hal0d's and its slot's) could
    otherwise get the same one, and the slot's process would find hal0d on its port."""
    while True:
        port = unused_port()
        if port not in _handed_out:
            _handed_out.add(port)
            return port
