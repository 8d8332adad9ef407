"""The operator's endpoints: health, slot states, live metrics, request history, Prometheus."""

from __future__ import annotations

from aiohttp import web

from hal0d.appkeys import SLOTS


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def slots(request: web.Request) -> web.Response:
    return web.json_response({"slots": request.app[SLOTS].snapshot()})
