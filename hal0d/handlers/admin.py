"""The operator's endpoints: health, slot states, live metrics, request history, Prometheus."""

from __future__ import annotations

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from hal0d import __version__, access
from hal0d.appkeys import RECORDER, RUNTIME, SLOTS
from hal0d.errors import InvalidRequest
from hal0d.slots import SlotState

MAX_HISTORY_ROWS = 1000
# The states in which a slot takes a request without waiting for a start or a recovery.
READY_STATES = frozenset({SlotState.READY, SlotState.SERVING})


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
    ready = any(slot.state in READY_STATES for slot in table)
    detailed = access.may_see_details(request, request.app[RUNTIME].current.config.server)
    slots = [
        {"name": slot.name, "state": str(slot.state), "reason": slot.reason}
        if detailed else {"name": slot.name, "state": str(slot.state)}
        for slot in table
    ]
    return json(
        {"status": "ready" if ready else "not_ready", "version": __version__, "slots": slots},
        status=200 if ready else 503,
    )


async def slots(request: web.Request) -> web.Response:
    return json({"slots": request.app[SLOTS].snapshot()})


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
    history = request.app[RECORDER].history
    await history.flush()  # the rows of requests that already ended, not only of the last batch
    rows = await history.recent(int(raw))
    return json({"requests": rows})


async def prometheus(request: web.Request) -> web.Response:
    body = generate_latest(request.app[RECORDER].prom.registry)
    response = web.Response(body=body)
    response.headers["Content-Type"] = CONTENT_TYPE_LATEST
    return response
