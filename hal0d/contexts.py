"""The application's cleanup contexts: what runs for the app's whole life, set up before it
serves and torn down on shutdown, in the order make_app registers them (aiohttp tears them down
in reverse).

They live here, above the domain modules, because they wire those modules into the app's shared
state (appkeys.py): the recorder, the lifecycle manager and the token counter know nothing of the
app, and appkeys.py can name their types without any of them importing it back.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from aiohttp import web

from hal0d import appkeys
from hal0d.appkeys import (
    DEVICES,
    DISPATCH,
    EVENTS,
    HEADS,
    KEY_LIMITS,
    LIFECYCLE,
    OLLAMA_MODELS,
    RECORDER,
    RUNTIME,
    SHARE_BOOK,
    SLOTS,
    VIEWS,
)
from hal0d.config import SlotConfig
from hal0d.config.cache_dir import cache_root
from hal0d.conversations import Affinity
from hal0d.devices import Devices
from hal0d.forward import Dispatch
from hal0d.forward.contexts import Contexts
from hal0d.forward.modes import AnthropicModes, ResponsesModes
from hal0d.forward.ollama_models import OllamaModels
from hal0d.forward.placement import Placement
from hal0d.lifecycle.manager import LifecycleManager
from hal0d.lifecycle.remote import RemoteModels
from hal0d.lifecycle.table import SlotTable
from hal0d.observability.events import SlotFeed, SlotViews
from hal0d.observability.history import HistoryWriter
from hal0d.observability.recorder import Recorder
from hal0d.observability.timeline import FreeMemory, LifecycleLog, Timeline
from hal0d.shares.quotas import DAY, HOUR, LocalCounts, TokenCounts, window_of
from hal0d.transport.tokens import TokenCounter
from hal0d.transport.upstream import UpstreamClient


async def recorder_context(app: web.Application) -> AsyncIterator[None]:
    """The history writer runs for the app's life and is flushed on shutdown."""
    config = app[RUNTIME].current.config
    history = HistoryWriter(config.database_path(), retention_days=config.metrics.retention_days)
    await history.start()
    recorder = Recorder(history, config.metrics.ttft_samples)
    recorder.book, recorder.counts = app[SHARE_BOOK], app[KEY_LIMITS].counts
    await seed_quotas(history, app[KEY_LIMITS].counts)

    def restarts() -> dict[str, int]:
        lifecycle = app.get(LIFECYCLE)
        return {} if lifecycle is None else lifecycle.restarts()

    def placements() -> dict[str, SlotConfig]:
        return {slot.name: slot for slot in app[RUNTIME].current.config.slots}

    recorder.prom.watch_slots(lambda: app[SLOTS], recorder.live, restarts)
    recorder.prom.watch_lifecycle(
        lambda: app[SLOTS], placements, lambda: iter(app[RUNTIME].current.config.groups)
    )
    recorder.prom.watch_connections(lambda: app[HEADS].closed_total)
    app[RECORDER] = recorder
    yield
    await history.close()


async def seed_quotas(history: HistoryWriter, counts: TokenCounts) -> None:
    """hal0d's own quota counts (shares/quotas.LocalCounts) start from what the history says
    each key used this hour and today: a restart forgets nothing."""
    if not isinstance(counts, LocalCounts):
        return  # a shared store keeps its own
    now = time.time()
    for per in (HOUR, DAY):
        start = window_of(per, now)[0]
        counts.seed(per, start, await history.charged_since(start))


async def dispatch_context(app: web.Application) -> AsyncIterator[None]:
    """The one upstream client, the slot table, the lifecycle manager of its slots, the
    followers of other hal0d boxes' states, and the Dispatch the forward path is handed; on
    shutdown the slots' processes stop, then the client
    closes (the probes use it to the end)."""
    config = app[RUNTIME].current.config
    upstreams = UpstreamClient.create(config.dispatcher)
    table = SlotTable(config.slots, app[SHARE_BOOK])
    app[SLOTS] = table
    recorder = app[RECORDER]  # recorder_context runs first (make_app's order)
    remote = RemoteModels(upstreams)
    affinity = Affinity()
    placement = Placement(table, remote, affinity)
    dispatch = Dispatch(runtime=app[RUNTIME], slots=table, upstreams=upstreams,
                        tokens=TokenCounter(upstreams), anthropic_modes=AnthropicModes(),
                        responses_modes=ResponsesModes(), streams=set(),
                        on_failover=recorder.prom.failover, on_keepalive=recorder.prom.keepalive,
                        placement=placement, contexts=Contexts(table, upstreams))
    app[DISPATCH] = dispatch
    lifecycle = LifecycleManager(table, config.slots, upstreams, groups=config.groups,
                                 end_streams=dispatch.end_streams, warmth=affinity,
                                 cache_root=cache_root(config.database_path()))
    app[LIFECYCLE] = lifecycle
    app[OLLAMA_MODELS] = OllamaModels(dispatch, lifecycle.unloads_in)
    views = SlotViews(lifecycle.slot_view)
    app[VIEWS] = views
    feed = SlotFeed(app[EVENTS], views)
    recorder.listeners.append(feed.request_finished)
    past = LifecycleLog(keep=recorder.history.submit)
    past.restore(await recorder.history.lifecycle_since(time.time() - past.keep_s))
    for observer in (recorder.prom.lifecycle, views, feed, placement.cooldowns, past):
        lifecycle.subscribe(observer)
    app[appkeys.TIMELINE] = Timeline(past, FreeMemory())
    try:
        await lifecycle.start()
        remote.watch(config.slots)
        yield
        await remote.close()
        await lifecycle.stop()
    finally:
        await upstreams.close()


async def devices_context(app: web.Application) -> AsyncIterator[None]:
    """Each device's memory, read while hal0d runs (nothing runs on a box without a GPU and
    without a devices_command); its processes told apart by the slots' processes, so it starts
    after the lifecycle manager and stops before it."""
    lifecycle = app[LIFECYCLE]
    devices = Devices(app[RUNTIME].current.config.devices, lifecycle.slot_pids)
    app[DEVICES] = devices
    app[RECORDER].prom.watch_devices(lambda: devices.last)
    # What each model took, measured after its loads, replaces its memory_mib in its group.
    footprints = lifecycle.footprints
    footprints.attach(devices.read)
    lifecycle.devices = devices  # each load placed where it fits, room made by cost
    lifecycle.subscribe(footprints)
    await devices.start()
    lifecycle.refresh_bounds(None)  # the slots sharing the box wait their turns there
    yield
    lifecycle.devices = None
    await footprints.close()
    await devices.stop()
