"""The OpenAI Responses API: POST /v1/responses (and /llm/v1/responses), GET and DELETE
/v1/responses/{id}.

A request is dispatched by `model` like a chat completion (aliases applied) and relayed byte for
byte, status and content type verbatim; a stream goes through the relay with the Responses
transform (hal0d/openai/responses.py), which ends a stalled or broken stream in Responses events.
The id of every answer is remembered with its model (hal0d/openai/owners.py), so that GET and
DELETE of an answer reach the slot that holds it; an id hal0d never saw is a 404.

A slot with `responses = "translate"` (or "auto", when its upstream has no /v1/responses: see
transport/anthropic_mode.py) serves only chat completions: the request is translated into one
(hal0d/openai/responses_request.py) and the answer back into Responses events
(hal0d/openai/responses_bridge.py). Such an answer is kept nowhere, so its id is not remembered.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import orjson
from aiohttp import hdrs, web

from hal0d.appkeys import DISPATCH, RESPONSE_OWNERS
from hal0d.errors import ErrorCode, InvalidRequest, NoRoute, UpstreamInvalid
from hal0d.forward import Forward
from hal0d.handlers.body import parse_json_object, read_body
from hal0d.handlers.openai import model_and_stream, with_model
from hal0d.logs import get_logger
from hal0d.observability.requestinfo import INFO, client_of
from hal0d.openai.responses import ResponsesTransform, response_id_of
from hal0d.openai.responses_bridge import Bridge, BridgeTransform
from hal0d.openai.responses_request import ChatRequest, chat_request, to_response
from hal0d.protocol.limits import MAX_TOKENS_LIMIT
from hal0d.transport.anthropic_mode import NATIVE, TRANSLATE
from hal0d.transport.tap import normal_usage
from hal0d.transport.upstream import SSE_HEADERS, response_headers

log = get_logger()


def requested(payload: dict[str, Any]) -> tuple[str, bool]:
    """The model and whether a stream was asked for; what no upstream could serve is refused
    here, in OpenAI's envelope, before a slot is taken."""
    model, stream = model_and_stream(payload)
    given = payload.get("input")
    if given is not None and not isinstance(given, str | list):
        raise InvalidRequest("'input' must be a string or an array", field="input")
    limit = payload.get("max_output_tokens")
    if limit is not None and (type(limit) is not int or not 1 <= limit <= MAX_TOKENS_LIMIT):
        raise InvalidRequest(
            f"'max_output_tokens' must be an integer from 1 to {MAX_TOKENS_LIMIT}, not {limit!r}",
            field="max_output_tokens",
        )
    return model, stream


async def create(request: web.Request) -> web.StreamResponse:
    body = await read_body(request)
    payload = parse_json_object(body)
    model, stream = requested(payload)

    async def attempt(fwd: Forward) -> web.StreamResponse:
        # A request to translate is checked whole before the slot is taken; a native upstream
        # (and one that may turn out native, "auto") gets what the client sent.
        chat = bridged(fwd, payload) if fwd.slot.responses == TRANSLATE else None
        async with fwd:
            if chat is None and await fwd.responses_mode() == NATIVE:
                return await relay_native(fwd, body, model, stream=stream)
            return await translate(fwd, chat or bridged(fwd, payload), model)

    return await request.app[DISPATCH].serve(request, model, stream=stream, attempt=attempt,
                                             client=client_of(request[INFO], payload))


async def relay_native(fwd: Forward, body: bytes, model: str, *,
                       stream: bool) -> web.StreamResponse:
    """The request at the upstream's own /v1/responses; its answer relayed as it came."""
    if fwd.route.served_model != model:
        body = with_model(body, fwd.route.served_model)
    upstream = await fwd.open("/v1/responses", body, params=fwd.request.query)
    if not stream or upstream.status != 200:
        return await relay_whole(fwd, model)
    if upstream.content_type != "text/event-stream":
        whole = await relay_whole(fwd, model)
        # Asked for a stream, answered with something else.
        fwd.info.fail(ErrorCode.UPSTREAM_INVALID)
        return whole
    response = web.StreamResponse(
        status=upstream.status, headers=response_headers(upstream.headers)
    )
    transform = ResponsesTransform(model=fwd.route.served_model)
    try:
        await fwd.relay(response, transform)
    finally:
        if transform.response_id is not None:
            fwd.request.app[RESPONSE_OWNERS].remember(transform.response_id, model,
                                                      fwd.slot.name)
    return response


def bridged(fwd: Forward, payload: dict[str, Any]) -> ChatRequest:
    """The chat completion a translated slot is sent (InvalidRequest, 400, for what a chat
    upstream cannot do); the tools left out are logged."""
    chat = chat_request(payload, served_model=fwd.route.served_model,
                        max_output_tokens=fwd.slot.max_output_tokens)
    if chat.tools.dropped:
        log.debug("responses.tools_dropped", slot=fwd.slot.name,
                  types=sorted(set(chat.tools.dropped)))
    return chat


async def translate(fwd: Forward, chat: ChatRequest, model: str) -> web.StreamResponse:
    """The Responses request as a chat completion; the answer translated back. An upstream's
    error status is relayed as it came (OpenAI's envelope already)."""
    upstream = await fwd.open("/v1/chat/completions", orjson.dumps(chat.body))
    if upstream.status != 200:
        data = await fwd.read_whole()
        return web.Response(body=data, status=upstream.status,
                            headers=response_headers(upstream.headers))
    if not chat.stream:
        raw = await fwd.read_whole()
        try:
            answer = to_response(orjson.loads(raw), chat, model=model)
        except (orjson.JSONDecodeError, ValueError):
            raise UpstreamInvalid(
                f"slot {fwd.slot.name!r} answered with no chat completion to translate"
            ) from None
        usage = answer["usage"]
        fwd.info.apply_usage({"prompt_tokens": usage["input_tokens"],
                              "completion_tokens": usage["output_tokens"]})
        return web.Response(body=orjson.dumps(answer), content_type="application/json")
    if upstream.content_type != "text/event-stream":
        raise UpstreamInvalid(
            f"slot {fwd.slot.name!r} answered a streaming request with "
            f"content-type {upstream.content_type!r}, not text/event-stream"
        )
    response = web.StreamResponse(status=200, headers=SSE_HEADERS)
    await fwd.relay(response, BridgeTransform(Bridge(chat, model)))
    return response


async def relay_whole(fwd: Forward, model: str) -> web.Response:
    """A whole answer copied through as it came; its id remembered, its usage noted."""
    upstream = fwd.upstream
    assert upstream is not None
    data = await fwd.read_whole()
    if not data and upstream.status == 200:
        raise UpstreamInvalid(f"slot {fwd.slot.name!r} answered 200 with an empty body")
    if upstream.status == 200 and upstream.content_type == "application/json":
        try:
            parsed = orjson.loads(data)
        except orjson.JSONDecodeError:
            parsed = None
        response_id = response_id_of(parsed)
        if response_id is not None:
            fwd.request.app[RESPONSE_OWNERS].remember(response_id, model, fwd.slot.name)
        if isinstance(parsed, dict) and isinstance(parsed.get("usage"), dict):
            fwd.info.apply_usage(normal_usage(parsed["usage"]))
    return web.Response(
        body=data, status=upstream.status, headers=response_headers(upstream.headers)
    )


async def stored(request: web.Request) -> web.StreamResponse:
    """GET, HEAD or DELETE /v1/responses/{id}: sent to the slot whose model made the answer.
    A HEAD is answered as its GET would be, without the body: the upstream's status and headers,
    its Content-Length included."""
    response_id = request.match_info["id"]
    owners = request.app[RESPONSE_OWNERS]
    owner = owners.owner(response_id)
    if owner is None:
        raise NoRoute(
            f"no response {response_id!r} is known to hal0d: it was not made through it, or "
            "is older than the last few thousand answers it remembers"
        )
    fwd = request.app[DISPATCH].forward(request, owner.model, stream=False, slot=owner.slot)
    async with fwd:
        upstream = await fwd.open(
            f"/v1/responses/{quote(response_id, safe='')}", b"", json_body=False,
            params=request.query, method=request.method,
        )
        data = await fwd.read_whole()
    if request.method == hdrs.METH_DELETE and upstream.status < 300:
        owners.forget(response_id)
    headers = response_headers(upstream.headers)
    if request.method == hdrs.METH_HEAD and hdrs.CONTENT_LENGTH in upstream.headers:
        headers[hdrs.CONTENT_LENGTH] = upstream.headers[hdrs.CONTENT_LENGTH]
    return web.Response(body=data, status=upstream.status, headers=headers)
