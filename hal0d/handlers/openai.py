"""The OpenAI surface: POST /v1/<endpoint> (and /llm/v1/<endpoint>) dispatched to a slot.

The request is checked here and sent through the forward path (forward.py), which opens the
upstream eagerly (so a dead upstream is a clean 502); the answer is relayed byte for byte.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
from aiohttp import web

from hal0d.appkeys import DISPATCH, RUNTIME, SLOTS
from hal0d.errors import ErrorCode, InvalidRequest, UpstreamInvalid
from hal0d.forward import Forward
from hal0d.handlers.body import (
    check_model_and_stream,
    multipart_field,
    parse_json_object,
    read_body,
    replace_multipart_field,
)
from hal0d.keys import KEY
from hal0d.observability.requestinfo import INFO, client_of
from hal0d.openai.transform import Passthrough
from hal0d.protocol.limits import MAX_MESSAGES, MAX_TOKENS_LIMIT
from hal0d.transport.upstream import response_headers

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
OPENAI_FIELD = "'{}'"  # how the OpenAI surface names a field in an error message


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


async def requested_model(request: web.Request, endpoint: str, body: bytes
                          ) -> tuple[str, bool, str]:
    """The model name, whether the client asked for a stream, and whose turn it waits for
    (client_of). The parsed body is not kept: a long conversation's parse tree would live as
    long as the stream, where the body's bytes are all the attempts need."""
    if endpoint == "audio/transcriptions":
        model = await multipart_field(request, body, "model")
        if not model:
            raise InvalidRequest("multipart field 'model' is required", field="model")
        return model, False, client_of(request[INFO], None)
    payload = parse_json_object(body)
    model, stream = model_and_stream(payload)
    check_fields(endpoint, payload)
    return model, stream, client_of(request[INFO], payload)


def model_and_stream(payload: dict[str, Any]) -> tuple[str, bool]:
    """The two fields every OpenAI-shaped body (chat, completions, Responses) must get right
    before a slot is taken."""
    return check_model_and_stream(payload, OPENAI_FIELD)


def with_model(body: bytes, served_model: str) -> bytes:
    payload: dict[str, Any] = orjson.loads(body)
    payload["model"] = served_model
    return orjson.dumps(payload)


async def dispatch(request: web.Request) -> web.StreamResponse:
    endpoint = request.match_info["endpoint"]
    body = await read_body(request)
    model, stream, client = await requested_model(request, endpoint, body)
    streaming = stream or endpoint in ALWAYS_STREAMING

    async def attempt(fwd: Forward) -> web.StreamResponse:
        served_model = fwd.route.served_model
        sent = body  # each slot gets the body as the client sent it, its own model name in it
        if served_model != model:
            if endpoint == "audio/transcriptions":
                sent = replace_multipart_field(body, "model", model, served_model)
            else:
                sent = with_model(body, served_model)
        async with fwd:
            upstream = await fwd.open(
                f"/v1/{endpoint}",
                sent,
                # Parsed as JSON: said so even when the client did not (`curl -d` sends a form
                # content-type, which strict upstreams such as llama-cpp-python refuse).
                json_body=endpoint != "audio/transcriptions",
                params=request.query,
            )
            if not streaming:
                return await copy_whole(fwd, upstream)
            if not_streamed(endpoint, upstream):
                # Asked for a stream, answered with something else: relayed as it came (status
                # and content-type are the upstream's), but recorded as the failure it is.
                whole = await copy_whole(fwd, upstream)
                fwd.info.fail(ErrorCode.UPSTREAM_INVALID)
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
            await fwd.relay(response, transform)
            return response

    return await request.app[DISPATCH].serve(request, model, stream=streaming, attempt=attempt,
                                             client=client)


async def copy_whole(fwd: Forward, upstream: aiohttp.ClientResponse) -> web.Response:
    """A non-streaming answer, copied through as it came; its usage noted when it has one."""
    data = await fwd.read_whole()
    if not data and upstream.status == 200:
        raise UpstreamInvalid(f"slot {fwd.slot.name!r} answered 200 with an empty body")
    if upstream.content_type == "application/json" and b'"usage"' in data:
        try:
            parsed = orjson.loads(data)
        except orjson.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict) and isinstance(parsed.get("usage"), dict):
            fwd.info.apply_usage(parsed["usage"])
    return web.Response(
        body=data, status=upstream.status, headers=response_headers(upstream.headers)
    )


async def list_models(request: web.Request) -> web.Response:
    config = request.app[RUNTIME].current.config
    table = request.app[SLOTS]
    key = request.get(KEY)

    def state(slot: str) -> str:
        return str(table[slot].state) if slot in table else "offline"

    # Every model the key may use, loaded or not; `state` tells a client whether the first
    # request will load it (a route's: its best slot's, a warm one before one that must load).
    data = [
        {"id": model, "object": "model", "created": 0, "owned_by": slot.name,
         "state": state(slot.name)}
        for slot in config.slots
        for model in slot.models
        if key is None or key.may_use(model)
    ]
    dispatch = request.app[DISPATCH]
    for route in config.routes:
        if key is not None and not key.may_use(route.model):
            continue
        first = dispatch.order(dispatch.runtime.current.router.plan(route.model))[0]
        # Another hal0d's slot: the state that hal0d reports for the model, when known.
        remote = dispatch.remote.state(first.slot.name, first.served_model) if (
            dispatch.remote is not None) else None
        data.append({"id": route.model, "object": "model", "created": 0,
                     "owned_by": first.slot.name, "state": remote or state(first.slot.name),
                     "slots": list(route.slots)})
    return web.json_response({"object": "list", "data": data})
