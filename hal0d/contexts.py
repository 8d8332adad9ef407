"""The application's cleanup contexts: what runs for the app's whole life, set up before it
serves and torn down on shutdown, in the order make_app registers them (aiohttp tears them down
in reverse).

They live here, above the domain modules, because they wire those modules into the app's shared
state (appkeys.py): the recorder, the lifecycle manager and the token counter know nothing of the
app, and appkeys.py can name their types without any of them importing it back.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web

from hal0d.appkeys import (
    EVENTS,
    LIFECYCLE,
    RECORDER,
    RUNTIME,
    SESSION,
    SLOTS,
    STREAMS,
    TOKEN_COUNTER,
)
from hal0d.config import SlotConfig
from hal0d.events import SlotFeed
from hal0d.lifecycle.manager import LifecycleManager, log_state_change
from hal0d.lifecycle.slots import SlotTable
from hal0d.metrics.history import HistoryWriter
from hal0d.metrics.recorder import Recorder
from hal0d.tokens import TokenCounter
from hal0d.upstream import make_session


async def session_context(app: web.Application) -> AsyncIterator[None]:
    """The one shared ClientSession for every upstream call, and the token counter that asks
    through it."""
    timeouts = app[RUNTIME].current.config.dispatcher
    app[SESSION] = make_session(timeouts)
    app[TOKEN_COUNTER] = TokenCounter(app[SESSION])
    yield
    await app[SESSION].close()


async def recorder_context(app: web.Application) -> AsyncIterator[None]:
    """The history writer runs for the app's life and is flushed on shutdown."""
    config = app[RUNTIME].current.config
    history = HistoryWriter(config.database_path(), retention_days=config.metrics.retention_days)
    await history.start()
    recorder = Recorder(history, config.metrics.ttft_samples)

    def restarts() -> dict[str, int]:
        lifecycle = app.get(LIFECYCLE)
        return {} if lifecycle is None else lifecycle.restarts()

    def placements() -> dict[str, SlotConfig]:
        return {slot.name: slot for slot in app[RUNTIME].current.config.slots}

    recorder.prom.watch_slots(lambda: app[SLOTS], recorder.live, restarts)
    recorder.prom.watch_lifecycle(
        lambda: app[SLOTS], placements, lambda: iter(app[RUNTIME].current.config.groups)
    )
    app[RECORDER] = recorder
    yield
    await history.close()


async def slots_context(app: web.Application) -> AsyncIterator[None]:
    """The slot table and the lifecycle manager of its slots, stopped on shutdown."""
    config = app[RUNTIME].current.config
    table = SlotTable(config.slots, on_change=log_state_change)
    app[SLOTS] = table
    streams = app[STREAMS]

    def end_streams(slot: str, reason: str) -> int:
        ending = [guard for guard in streams if guard.upstream == slot]
        for guard in ending:
            guard.end_now(reason)
        return len(ending)

    lifecycle = LifecycleManager(table, config.slots, app[SESSION], groups=config.groups,
                                 end_streams=end_streams)
    recorder = app[RECORDER]  # recorder_context runs first (make_app's order)
    lifecycle.observers.append(recorder.prom.lifecycle)
    app[LIFECYCLE] = lifecycle
    feed = SlotFeed(app[EVENTS], lifecycle.slot_view)
    for slot in table:
        feed.watch(slot)
    lifecycle.slot_added.append(feed.watch)
    lifecycle.observers.append(feed)
    recorder.listeners.append(feed.request_finished)
    await lifecycle.start()
    yield
    await lifecycle.stop()
