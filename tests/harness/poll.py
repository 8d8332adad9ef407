"""The one poller: wait for an event instead of sleeping a fixed time, in a test with an event
loop (`eventually`) or without one (`eventually_sync`: subprocesses, files, /proc, a browser)."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")
POLL_S = 0.02  # how often the condition is asked: small against every deadline the tests give


def _last_answer(result: object, failure: AssertionError | None) -> str:
    return f"last check failed: {failure}" if failure is not None else f"last answer: {result!r}"


async def eventually(condition: Callable[[], T] | Callable[[], Awaitable[T]], timeout: float,
                     what: str) -> T:
    """Ask `condition` (a plain or an async function) every POLL_S until it returns something
    truthy, and return that.

    An AssertionError raised by `condition` means "not yet", so a condition can hold the test's
    own asserts and their messages. After `timeout` seconds the test fails with an AssertionError
    naming `what` and the last answer (or the last failed assert). The condition is always asked
    once more after the deadline, so a loop that fell behind cannot fail an event that came.
    """
    deadline = time.monotonic() + timeout
    while True:
        past = time.monotonic() > deadline
        failure: AssertionError | None = None
        result: Any = None
        try:
            result = condition()
            if inspect.isawaitable(result):
                result = await result
        except AssertionError as exc:
            failure = exc
        if _settled(result, failure, past, timeout, what):
            return result  # type: ignore[no-any-return]
        await asyncio.sleep(POLL_S)


def _settled(result: Any, failure: AssertionError | None, past: bool, timeout: float,
             what: str) -> bool:
    """True once the condition held; after the deadline, the failure naming `what`."""
    if failure is None and result:
        return True
    if past:
        raise AssertionError(f"not within {timeout} s: {what}; "
                             f"{_last_answer(result, failure)}") from failure
    return False


def eventually_sync(condition: Callable[[], T], timeout: float, what: str) -> T:
    """`eventually` for a test without an event loop: a loop of its own runs for the wait."""
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(eventually(condition, timeout, what))
    finally:
        loop.close()
