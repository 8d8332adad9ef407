"""What every endpoint does with its request on the way in and when it fails: the JSON body read
(a 400 when it is not a JSON object), errors in OpenAI's envelope (aiohttp's own too: an unknown
path, a wrong method, a body too large), and the start / end / cancelled lines each request
writes to the log, which the tests and the README's commands read.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from hal0d_stub.appkeys import LOG_KEY


def error_body(message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "code": None}}


def bad_request(message: str) -> web.HTTPBadRequest:
    return web.HTTPBadRequest(
        text=orjson.dumps(error_body(message)).decode(), content_type="application/json"
    )


async def read_json(request: web.Request) -> dict[str, Any]:
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        raise bad_request("invalid JSON") from None
    if not isinstance(body, dict):
        raise bad_request("body must be an object")
    return body


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# OpenAI's error types for the statuses aiohttp itself raises.
ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
               413: "invalid_request_error"}


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own errors (unknown path, wrong method, a body over client_max_size) are plain
    text; a client of an OpenAI-compatible server expects them in the OpenAI envelope."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.content_type == "application/json" or exc.status < 400:
            raise
        message = {
            404: f"no endpoint {request.method} {request.path} on the stub",
            405: f"{request.method} is not allowed on {request.path}",
            413: f"request body over {request.client_max_size} bytes",
        }.get(exc.status, exc.reason)
        kind = ERROR_TYPES.get(exc.status, "server_error")
        return web.json_response(error_body(message, kind), status=exc.status)


def logged(endpoint: str) -> Callable[[Handler], Handler]:
    """Wrap a handler with the start / end / cancelled log lines."""

    def wrap(handler: Handler) -> Handler:
        async def run(request: web.Request) -> web.StreamResponse:
            log = request.app[LOG_KEY]
            rid = uuid.uuid4().hex[:8]
            log.write(f"start rid={rid} endpoint={endpoint}")
            try:
                response = await handler(request)
            except asyncio.CancelledError:
                log.write(f"cancelled rid={rid} endpoint={endpoint} (client went away)")
                raise
            except ConnectionResetError:
                log.write(f"cancelled rid={rid} endpoint={endpoint} (connection reset)")
                raise
            except web.HTTPException as exc:
                log.write(f"end rid={rid} endpoint={endpoint} status={exc.status}")
                raise
            log.write(f"end rid={rid} endpoint={endpoint} status={response.status}")
            return response

        return run

    return wrap
