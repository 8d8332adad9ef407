"""The operator's endpoints: health, slot (and route) states, the devices' memory, the event
feed, live metrics, request history, Prometheus."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from hal0d import __version__
from hal0d.appkeys import (
    DEVICES,
    DISPATCH,
    EVENTS,
    LIFECYCLE,
    RECORDER,
    RESCAN,
    RUNTIME,
    SLOTS,
    VIEWS,
)
from hal0d.config import DispatcherConfig
from hal0d.devices.view import devices_view
from hal0d.errors import Conflict, ErrorCode, InvalidRequest, NoRoute
from hal0d.forward import Dispatch
from hal0d.front import access
from hal0d.library.view import library_view
from hal0d.lifecycle.manager import LifecycleManager
from hal0d.lifecycle.slots import Slot, SlotState
from hal0d.lifecycle.vocabulary import UP, UnloadReason
from hal0d.logs import get_logger
from hal0d.observability import events as feed
from hal0d.observability.requestinfo import INFO
from hal0d.observability.tally import HOUR_S
from hal0d.routing import best
from hal0d.transport.stallguard import client_bound_s
from hal0d.transport.upstream import SSE_HEADERS

MAX_HISTORY_ROWS = 1000
# A comment this often keeps a quiet feed's connection from looking dead to proxies and readers.
HEARTBEAT_S = 15.0
# The states in which a slot takes a request without waiting for a start or a recovery.

log = get_logger()


def json(body: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


async def healthz(request: web.Request) -> web.Response:
    """Liveness: 200 while the daemon answers at all, whatever its slots do (the systemd
    watchdog's meaning: restarting hal0d would not bring an upstream back)."""
    return json({"status": "ok", "version": __version__})


async def readyz(request: web.Request) -> web.Response:
    """Readiness: 200 when at least one slot can take a request now, else 503, so a load
    balancer or `curl --fail` sends traffic only where it can be served."""
    table = request.app[SLOTS]
    ready = any(slot.state in UP or loadable(slot) for slot in table)
    detailed = access.may_see_details(request, request.app[RUNTIME].current.keys)
    slots = [
        {"name": slot.name, "state": str(slot.state), "reason": slot.reason}
        if detailed else {"name": slot.name, "state": str(slot.state)}
        for slot in table
    ]
    return json(
        {"status": "ready" if ready else "not_ready", "version": __version__, "slots": slots},
        status=200 if ready else 503,
    )


def loadable(slot: Slot) -> bool:
    """An on-demand slot at rest, not refusing loads after a failure: a request would load it."""
    if slot.state is not SlotState.STOPPED or slot.demand is None:
        return False
    return slot.load_refused is None or slot.load_refused[0] <= time.monotonic()


async def slots(request: web.Request) -> web.Response:
    return json({"slots": [with_memory(request, request.app[VIEWS](slot))
                           for slot in request.app[SLOTS]],
                 "routes": route_views(request.app[DISPATCH]),
                 "groups": request.app[LIFECYCLE].group_views()})


def with_memory(request: web.Request, view: dict[str, Any]) -> dict[str, Any]:
    """A slot's view with, for a slot hal0d starts, `memory`: a library model's estimate and
    what it took at its last load (lifecycle/footprints.py), beside its `memory_mib`; and for
    every slot its `context` (forward/contexts.py: tokens and where the figure comes from)."""
    lifecycle = request.app[LIFECYCLE]
    config = lifecycle.configs.get(view["name"])
    if config is not None and config.command:
        view["memory"] = lifecycle.footprints.view(config)
    contexts = request.app[DISPATCH].contexts
    context = contexts.known(config) if config is not None and contexts is not None else None
    view["context"] = context.view() if context is not None else None
    return view


def route_views(dispatch: Dispatch) -> list[dict[str, Any]]:
    """Each [[routes]] model as /api/slots and the feed's `hello` show it: its state and the
    slot it is shown by (routing.best, as /v1/models lists it), its settings, and each of its
    slots (in the configured order) with the state a client is shown for it there."""
    views = []
    for plan in dispatch.runtime.current.router.listed(None):
        if (config := plan.route) is None:
            continue
        shown, state = best(dispatch.order(plan), dispatch.state_of)
        views.append({
            "model": plan.model, "state": state, "slot": shown.slot.name,
            "slots": [{"name": route.slot.name, "served": route.served_model,
                       "state": dispatch.state_of(route)} for route in plan.routes],
            "prefer_loaded": config.prefer_loaded, "spill_when_busy": config.spill_when_busy,
            "first_byte_timeout_s": config.first_byte_timeout_s,
        })
    return views


async def events(request: web.Request) -> web.StreamResponse:
    """GET /api/events: the event feed as server-sent events, starting with `hello` (every slot's
    view). Each frame is written as soon as it is published; a reader that falls behind loses
    events (told by a `dropped` event), never slows anyone else, and is forgotten when it leaves.
    A reader that takes no bytes for as long as a relayed stream's client may (`reader_bound`)
    is cut: a suspended `hal0d status --watch` or a stuck proxy would otherwise hold its
    connection and this handler for good once the socket's buffers are full.
    """
    response = web.StreamResponse(headers=SSE_HEADERS)
    hub = request.app[EVENTS]
    bound = reader_bound(request.app[RUNTIME].current.config.dispatcher)
    try:
        await response.prepare(request)
    except ConnectionResetError:
        return response
    # Subscribing and taking the snapshot in one step: every later change is in the queue.
    subscriber = hub.subscribe()
    hello = feed.frame("hello", {"ts": time.time(), "slots": [
        request.app[VIEWS](slot) for slot in request.app[SLOTS]
    ], "routes": route_views(request.app[DISPATCH])})
    try:
        data: bytes | None = hello
        while data is not None:
            if not await write_within(response, data, bound):
                reader_stalled(request, subscriber, bound)
                break
            # A feed has no end of its own: its reader leaving is how it ends, not a failure.
            request[INFO].answered = True
            try:
                async with asyncio.timeout(HEARTBEAT_S):
                    data = await subscriber.next()  # None once hal0d is stopping
            except TimeoutError:
                data = feed.HEARTBEAT
    except ConnectionResetError:
        pass  # the reader left
    finally:
        hub.unsubscribe(subscriber)
    return response


def reader_bound(timeouts: DispatcherConfig) -> float | None:
    """How long a feed write may wait for its reader to take bytes: the stall guard's bound on a
    relayed stream's client (transport/stallguard.py), so one setting says how long any client
    of hal0d may sit on a full socket. None (no bound) only when both are 0, as tests may set."""
    bound = client_bound_s(timeouts)
    return bound if bound > 0 else None


async def write_within(response: web.StreamResponse, data: bytes, bound: float | None) -> bool:
    """Whether the reader took `data` within `bound`. The timeout is around the raw write (the
    wait for the socket to drain); the response is not written to again after one ran out."""
    try:
        async with asyncio.timeout(bound):
            await response.write(data)
    except TimeoutError:
        return False
    return True


def reader_stalled(request: web.Request, subscriber: feed.Subscriber, bound: float | None
                   ) -> None:
    """The feed ends for a reader that took nothing within its bound: its connection is aborted
    (a close would wait on the very buffers it does not drain) and its request is a failure
    (client_stalled, as a relayed stream's stalled client is)."""
    log.warning("events.reader_stalled", bound_s=bound, queued=subscriber.pending,
                dropped=subscriber.dropped)
    request[INFO].fail(ErrorCode.CLIENT_STALLED)
    if request.transport is not None:
        request.transport.abort()


async def status(request: web.Request) -> web.Response:
    """The status page's header: version, uptime, requests served since start, and when the
    last hour's failures happened (from the history: they outlive a restart)."""
    recorder = request.app[RECORDER]
    tally = recorder.tally
    await recorder.history.flush()  # the rows of requests that already ended, still queued
    error_times = await recorder.history.failed_since(time.time() - HOUR_S)
    return json({
        "version": __version__,
        "uptime_s": round(time.time() - tally.started, 1),
        "requests": tally.served,
        "error_times": error_times,
    })


def on_demand_slot(request: web.Request) -> tuple[LifecycleManager, Slot]:
    name = request.match_info["name"]
    slot = request.app[SLOTS].get(name)
    if slot is None:
        raise NoRoute(f"no slot named {name!r}")
    lifecycle = request.app[LIFECYCLE]
    runner = lifecycle.runners.get(name)
    if runner is None or not runner.config.on_demand:
        raise Conflict(f"slot {name!r} is not start = 'on_demand': hal0d does not load or "
                       "unload it")
    return lifecycle, slot


def flag(request: web.Request, name: str, default: bool) -> bool:
    raw = request.query.get(name)
    if raw is None:
        return default
    if raw.lower() not in ("true", "false", "1", "0"):
        raise InvalidRequest(f"{name} must be true or false", field=name)
    return raw.lower() in ("true", "1")


async def load_slot(request: web.Request) -> web.Response:
    """POST /api/slots/{name}/load: answers once the slot is ready (?wait=false: 202 at once)."""
    lifecycle, slot = on_demand_slot(request)
    if not flag(request, "wait", True):
        lifecycle.request_load(slot.name)
        return json({"slot": slot.name, "state": str(slot.state)}, status=202)
    started = time.monotonic()
    await lifecycle.load(slot.name)
    return json({"slot": slot.name, "state": str(slot.state),
                 "waited_ms": round((time.monotonic() - started) * 1000, 1)})


async def unload_slot(request: web.Request) -> web.Response:
    """POST /api/slots/{name}/unload: drains, then stops the process. With requests queued it
    refuses (409) unless ?force=true, which ends the in-flight streams with their terminal frame
    and fails the queued with a 503."""
    lifecycle, slot = on_demand_slot(request)
    force = flag(request, "force", False)
    if slot.queued and not force:
        raise Conflict(f"slot {slot.name!r} has {slot.queued} requests queued; "
                       "?force=true fails them and ends the ones in flight")
    await lifecycle.unload(slot.name, UnloadReason.API, force=force)
    return json({"slot": slot.name, "state": str(slot.state)})


async def devices(request: web.Request) -> web.Response:
    """GET /api/devices: the devices' last reading (none read: source null), each with its
    processes and their slots, and its free memory over the last hour."""
    return json(devices_view(request.app[DEVICES]))


async def library(request: web.Request) -> web.Response:
    """GET /api/library: the models the [[library]] sources hold, their slots and states."""
    return json(library_view(request.app[RUNTIME].current.config, states(request)))


async def rescan_library(request: web.Request) -> web.Response:
    """POST /api/library/rescan: the config read again with its sources rescanned (a SIGHUP's
    reload), answered once it is applied: what is found then."""
    rescan = request.app.get(RESCAN)
    if rescan is None:
        raise Conflict("this hal0d was not started by `hal0d serve`: nothing to rescan from")
    await rescan()
    return json(library_view(request.app[RUNTIME].current.config, states(request)))


def states(request: web.Request) -> dict[str, str]:
    return {slot.name: str(slot.state) for slot in request.app[SLOTS]}


async def slot_metrics(request: web.Request) -> web.Response:
    recorder = request.app[RECORDER]
    return json(
        {
            "slots": [
                {"name": slot.name, **recorder.slot_metrics(slot.name).snapshot()}
                for slot in request.app[SLOTS]
            ]
        }
    )


async def requests(request: web.Request) -> web.Response:
    raw = request.query.get("limit", "100")
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= MAX_HISTORY_ROWS:
        raise InvalidRequest(
            f"limit must be an integer from 1 to {MAX_HISTORY_ROWS}", field="limit"
        )
    key = request.query.get("key") or None
    since, until = unix_time(request, "since"), unix_time(request, "until")
    history = request.app[RECORDER].history
    await history.flush()  # the rows of requests that already ended, still in the writer's queue
    rows = await history.recent(int(raw), key, since, until)
    return json({"requests": rows})


def unix_time(request: web.Request, name: str) -> float | None:
    raw = request.query.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise InvalidRequest(f"{name} must be a unix time in seconds", field=name)
    return value


async def prometheus(request: web.Request) -> web.Response:
    body = generate_latest(request.app[RECORDER].prom.registry)
    response = web.Response(body=body)
    response.headers["Content-Type"] = CONTENT_TYPE_LATEST
    return response
