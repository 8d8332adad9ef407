"""The Anthropic surface: POST /llm/v1/messages (and /v1/messages), count_tokens.

The request is translated to OpenAI chat completions and sent through the forward path
(forward.py) like any other; a stream comes back through the relay's Anthropic transform. Before
message_start every failure is a real HTTP status with Anthropic's error body; after it, one
`event: error` frame ends the stream.

A slot with `anthropic = "native"` (or "auto", when its upstream has the endpoint: see
anthropic_mode.py) gets the request as the client sent it (only an aliased model renamed), at its
own /v1/messages, with the client's anthropic-version and anthropic-beta headers; its answer is
relayed byte for byte, a stream through the native transform (hal0d/anthropic/native.py).
"""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
from aiohttp import web

from hal0d.anthropic.native import NativeAnthropic
from hal0d.anthropic.request import (
    MessagesRequest,
    parse_messages_request,
    prompt_text,
    to_openai,
)
from hal0d.anthropic.response import to_anthropic
from hal0d.anthropic.stream import Translator
from hal0d.anthropic.transform import AnthropicTransform
from hal0d.appkeys import DISPATCH
from hal0d.errors import (
    ErrorCode,
    UpstreamInvalid,
    UpstreamStatus,
    upstream_message,
)
from hal0d.forward import Forward
from hal0d.handlers.body import check_model_and_stream, parse_json_object, read_body
from hal0d.handlers.openai import with_model
from hal0d.observability.requestinfo import INFO, client_of
from hal0d.transport.anthropic_mode import NATIVE, TRANSLATE
from hal0d.transport.tap import normal_usage
from hal0d.transport.upstream import SSE_HEADERS, response_headers

UPSTREAM_MESSAGE_LIMIT = 2000
ANTHROPIC_FIELD = "{}:"  # how the Anthropic surface names a field in an error message


async def upstream_status_error(fwd: Forward, upstream: aiohttp.ClientResponse) -> UpstreamStatus:
    """The upstream's error status and message, kept, for Anthropic's error envelope."""
    raw = await fwd.read_whole()
    try:
        message = upstream_message(orjson.loads(raw))
    except orjson.JSONDecodeError:
        message = None
    if message is None:
        message = raw.decode("utf-8", "replace").strip()
    # Some servers put their Python traceback in the message; the client gets the message only.
    message = message.split('\n  File "', 1)[0].strip()
    message = message[:UPSTREAM_MESSAGE_LIMIT] or f"upstream answered {upstream.status}"
    return UpstreamStatus(upstream.status, f"slot {fwd.slot.name!r}: {message}")


async def native(fwd: Forward) -> bool:
    """Whether this slot's upstream is sent the Anthropic request as it is (asked under the
    lease: an "auto" slot's upstream is up to answer the probe)."""
    return await fwd.anthropic_mode() == NATIVE


def model_and_stream(body: dict[str, Any]) -> tuple[str, bool]:
    """What the dispatch needs of any Messages request; a native upstream judges the rest."""
    return check_model_and_stream(body, ANTHROPIC_FIELD)


async def messages(request: web.Request) -> web.StreamResponse:
    raw = await read_body(request)
    body = parse_json_object(raw)
    model, stream = model_and_stream(body)

    async def attempt(fwd: Forward) -> web.StreamResponse:
        # A request to translate is checked whole before the slot is taken; a native upstream
        # (and one that may turn out native, "auto") gets what the client sent, fields it may
        # know and the translator does not included.
        req = parse_messages_request(body) if fwd.slot.anthropic == TRANSLATE else None
        async with fwd:
            if req is None and await native(fwd):
                return await relay_native(fwd, raw, "/v1/messages", stream=stream)
            return await translated(fwd, req or parse_messages_request(body))

    return await request.app[DISPATCH].serve(request, model, stream=stream, attempt=attempt,
                                             client=client_of(request[INFO], body))


async def translated(fwd: Forward, req: MessagesRequest) -> web.StreamResponse:
    """The Messages request as a chat completion, and its answer translated back."""
    payload = to_openai(
        req, served_model=fwd.route.served_model, max_output_tokens=fwd.slot.max_output_tokens
    )
    input_tokens = None
    if req.stream:
        input_tokens, _ = await fwd.count_tokens(payload, prompt_text(payload))
    upstream = await fwd.open("/v1/chat/completions", orjson.dumps(payload))
    if upstream.status >= 400:
        raise await upstream_status_error(fwd, upstream)
    if not req.stream:
        return await translate_whole(fwd, req)
    if upstream.content_type != "text/event-stream":
        raise UpstreamInvalid(
            f"slot {fwd.slot.name!r} answered a streaming request with "
            f"content-type {upstream.content_type!r}, not text/event-stream"
        )
    translator = Translator(
        req.model, input_tokens=input_tokens, stop_sequences=req.stop_sequences
    )
    response = web.StreamResponse(status=200, headers=SSE_HEADERS)
    await fwd.relay(response, AnthropicTransform(translator))
    if fwd.info.prompt_tokens is None:
        fwd.info.prompt_tokens = translator.input_tokens
    return response


async def translate_whole(fwd: Forward, req: MessagesRequest) -> web.Response:
    """A non-streaming chat completion, translated into one Anthropic Messages response."""
    raw = await fwd.read_whole()
    try:
        parsed = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise UpstreamInvalid(f"slot {fwd.slot.name!r} answered with invalid JSON") from None
    message = to_anthropic(parsed, model=req.model, stop_sequences=req.stop_sequences)
    fwd.info.apply_usage(
        {
            "prompt_tokens": message["usage"]["input_tokens"],
            "completion_tokens": message["usage"]["output_tokens"],
        }
    )
    return web.Response(body=orjson.dumps(message), content_type="application/json")


async def relay_native(
    fwd: Forward, raw: bytes, path: str, *, stream: bool
) -> web.StreamResponse:
    """The client's request at the upstream's own Messages endpoint; its answer as it came."""
    model = fwd.info.model or ""
    body = raw if fwd.route.served_model == model else with_model(raw, fwd.route.served_model)
    upstream = await fwd.open(path, body, params=fwd.request.query)
    if stream and upstream.status == 200 and upstream.content_type == "text/event-stream":
        response = web.StreamResponse(status=200, headers=response_headers(upstream.headers))
        await fwd.relay(response, NativeAnthropic())
        return response
    data = await fwd.read_whole()
    if upstream.status == 200:
        if stream:
            # Asked for a stream, answered with something else.
            fwd.info.fail(ErrorCode.UPSTREAM_INVALID)
        try:
            parsed = orjson.loads(data)
        except orjson.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict) and isinstance(parsed.get("usage"), dict):
            fwd.info.apply_usage(normal_usage(parsed["usage"]))
        elif isinstance(parsed, dict) and isinstance(parsed.get("input_tokens"), int):
            fwd.info.prompt_tokens = parsed["input_tokens"]  # count_tokens
    return web.Response(
        body=data, status=upstream.status, headers=response_headers(upstream.headers)
    )


async def count_tokens(request: web.Request) -> web.StreamResponse:
    raw = await read_body(request)
    body = parse_json_object(raw)
    model, _ = model_and_stream(body)
    # count_tokens takes the Messages body without max_tokens; the parser requires one.
    body.setdefault("max_tokens", 1)
    body["stream"] = False

    async def attempt(fwd: Forward) -> web.StreamResponse:
        req = parse_messages_request(body) if fwd.slot.anthropic == TRANSLATE else None
        async with fwd:
            if req is None and await native(fwd):
                return await relay_native(fwd, raw, "/v1/messages/count_tokens", stream=False)
            payload = to_openai(req or parse_messages_request(body),
                                served_model=fwd.route.served_model)
            count, source = await fwd.count_tokens(payload, prompt_text(payload))
        fwd.info.prompt_tokens = count
        return web.Response(
            body=orjson.dumps({"input_tokens": count}),
            content_type="application/json",
            headers={"X-Hal0d-Token-Count": source},
        )

    return await request.app[DISPATCH].serve(request, model, stream=False, attempt=attempt,
                                             client=client_of(request[INFO], body))
