"""The OpenAI surface: POST /v1/<endpoint> (and /llm/v1/<endpoint>) dispatched to a slot.

The upstream is opened eagerly and its headers awaited before the client's response starts (so a
dead upstream is a clean 502), then the body is relayed byte for byte.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
from aiohttp import hdrs, web
from multidict import CIMultiDict

from hal0d.appkeys import RUNTIME, SESSION, SLOTS
from hal0d.config import DispatcherConfig, SlotConfig
from hal0d.errors import InvalidRequest, UpstreamInvalid
from hal0d.handlers.body import (
    multipart_field,
    parse_json_object,
    read_body,
    replace_multipart_field,
)
from hal0d.handlers.streaming import release_upstream, stream_through
from hal0d.limits import MAX_MESSAGES, MAX_TOKENS_LIMIT
from hal0d.openai.transform import Passthrough
from hal0d.requestinfo import INFO, RequestInfo
from hal0d.stallguard import guard_active
from hal0d.upstream import open_upstream, read_whole, request_headers, response_headers

ENDPOINTS = (
    "chat/completions",
    "completions",
    "embeddings",
    "audio/speech",
    "audio/transcriptions",
    "images/generations",
    "rerank",
)
# Endpoints whose answer is a byte stream even without `"stream": true`.
ALWAYS_STREAMING = frozenset({"audio/speech"})
# Endpoints whose stream is SSE.
SSE_ENDPOINTS = frozenset({"chat/completions", "completions"})


def not_streamed(endpoint: str, upstream: aiohttp.ClientResponse) -> bool:
    return (
        endpoint in SSE_ENDPOINTS
        and upstream.status == 200
        and upstream.content_type != "text/event-stream"
    )




def check_fields(endpoint: str, payload: dict[str, Any]) -> None:
    """Reject what no upstream could serve, in hal0d's envelope, before a slot is taken.

    Only the fields every OpenAI-compatible server reads the same way; the rest is the
    upstream's to judge, and its 4xx is relayed verbatim.
    """
    for name in ("max_tokens", "max_completion_tokens"):
        value = payload.get(name)
        if value is not None and (type(value) is not int or not 1 <= value <= MAX_TOKENS_LIMIT):
            raise InvalidRequest(
                f"'{name}' must be an integer from 1 to {MAX_TOKENS_LIMIT}, not {value!r}",
                field=name,
            )
    for name in ("temperature", "top_p"):
        value = payload.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise InvalidRequest(f"'{name}' must be a number", field=name)
    options = payload.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise InvalidRequest("'stream_options' must be an object", field="stream_options")
    if endpoint != "chat/completions":
        return
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty array", field="messages")
    if len(messages) > MAX_MESSAGES:
        raise InvalidRequest(f"'messages' holds more than {MAX_MESSAGES} items", field="messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequest(
                "each message must be an object with a string 'role'", field=f"messages.{index}"
            )


async def requested_model(
    request: web.Request, endpoint: str, body: bytes
) -> tuple[str, bool, bytes]:
    """The model name, whether the client asked for a stream, and the body to parse further."""
    if endpoint == "audio/transcriptions":
        model = await multipart_field(request, body, "model")
        if not model:
            raise InvalidRequest("multipart field 'model' is required", field="model")
        return model, False, body
    payload = parse_json_object(body)
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' is required and must be a non-empty string", field="model")
    stream = payload.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidRequest("'stream' must be a boolean", field="stream")
    check_fields(endpoint, payload)
    return model, stream, body


def upstream_headers(request: web.Request, endpoint: str, slot: SlotConfig) -> CIMultiDict[str]:
    headers = request_headers(request.headers, slot)
    if endpoint != "audio/transcriptions":
        # The body was parsed as JSON; say so even when the client did not (`curl -d` sends
        # a form content-type, which strict upstreams such as llama-cpp-python refuse).
        headers[hdrs.CONTENT_TYPE] = "application/json"
    return headers


def with_model(body: bytes, served_model: str) -> bytes:
    payload: dict[str, Any] = orjson.loads(body)
    payload["model"] = served_model
    return orjson.dumps(payload)


async def dispatch(request: web.Request) -> web.StreamResponse:
    endpoint = request.match_info["endpoint"]
    info = request[INFO]
    runtime = request.app[RUNTIME].current
    body = await read_body(request)
    model, stream, body = await requested_model(request, endpoint, body)
    streaming = stream or endpoint in ALWAYS_STREAMING
    info.model, info.stream = model, streaming
    route = runtime.router.resolve(model)
    if route.served_model != model:
        if endpoint == "audio/transcriptions":
            body = replace_multipart_field(body, "model", model, route.served_model)
        else:
            body = with_model(body, route.served_model)
    info.served_model, info.slot = route.served_model, route.slot.name
    timeouts = route.slot.timeouts(runtime.config.dispatcher)
    async with request.app[SLOTS].lease(route.slot.name) as lease:
        info.queue_ms = lease.queue_ms
        upstream = await open_upstream(
            request.app[SESSION],
            route.slot,
            timeouts,
            method=hdrs.METH_POST,
            path=f"/v1/{endpoint}",
            params=request.query,
            headers=upstream_headers(request, endpoint, route.slot),
            body=body,
            guarded=streaming and guard_active(timeouts),
            slot_reason=lease.slot.reason,
        )
        try:
            info.upstream_status(upstream.status)
            if not streaming:
                return await answer_whole(upstream, info, route.slot.name, timeouts)
            if not_streamed(endpoint, upstream):
                # Asked for a stream, answered with something else: relayed as it came (status
                # and content-type are the upstream's), but recorded as the failure it is.
                whole = await answer_whole(upstream, info, route.slot.name, timeouts)
                info.fail("upstream_invalid")
                return whole
            response = web.StreamResponse(
                status=upstream.status, headers=response_headers(upstream.headers)
            )
            sse = upstream.content_type == "text/event-stream"
            transform = Passthrough(
                sse=sse,
                legacy_completion=endpoint == "completions",
                model=model,
                expect_done=sse and upstream.status == 200,
            )
            await stream_through(
                request, upstream, response, transform, timeouts=timeouts, slot_name=route.slot.name
            )
            return response
        finally:
            release_upstream(upstream)


async def answer_whole(
    upstream: aiohttp.ClientResponse,
    info: RequestInfo,
    slot_name: str,
    timeouts: DispatcherConfig,
) -> web.Response:
    """A non-streaming answer, copied through as it came."""
    data = await read_whole(upstream, slot_name, timeouts.direct_read_timeout_s)
    if not data and upstream.status == 200:
        raise UpstreamInvalid(f"slot {slot_name!r} answered 200 with an empty body")
    if upstream.content_type == "application/json" and b'"usage"' in data:
        try:
            parsed = orjson.loads(data)
        except orjson.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict) and isinstance(parsed.get("usage"), dict):
            info.apply_usage(parsed["usage"])
    return web.Response(
        body=data, status=upstream.status, headers=response_headers(upstream.headers)
    )


async def list_models(request: web.Request) -> web.Response:
    config = request.app[RUNTIME].current.config
    table = request.app[SLOTS]
    # Every model, loaded or not; `state` tells a client whether the first request will load it.
    data = [
        {"id": model, "object": "model", "created": 0, "owned_by": slot.name,
         "state": str(table[slot.name].state) if slot.name in table else "offline"}
        for slot in config.slots
        for model in slot.models
    ]
    return web.json_response({"object": "list", "data": data})
