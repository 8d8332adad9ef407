"""The Anthropic surface: POST /llm/v1/messages (and /v1/messages), count_tokens.

The request is translated to OpenAI chat completions and sent to the slot like any other; a
stream comes back through the relay's Anthropic transform. Before message_start every failure is
a real HTTP status with Anthropic's error body; after it, one `event: error` frame ends the stream.
"""

from __future__ import annotations

import aiohttp
import orjson
from aiohttp import hdrs, web

from hal0d.anthropic.request import parse_messages_request, prompt_text, to_openai
from hal0d.anthropic.response import to_anthropic
from hal0d.anthropic.stream import Translator
from hal0d.anthropic.transform import AnthropicTransform
from hal0d.appkeys import RUNTIME, SESSION, SLOTS, TOKEN_COUNTER
from hal0d.config import DispatcherConfig
from hal0d.errors import UpstreamInvalid, UpstreamStatus
from hal0d.handlers.body import parse_json_object, read_body
from hal0d.handlers.streaming import release_upstream, stream_through
from hal0d.requestinfo import INFO, RequestInfo
from hal0d.stallguard import guard_active
from hal0d.upstream import open_upstream, read_whole, request_headers

SSE_HEADERS = {
    hdrs.CONTENT_TYPE: "text/event-stream; charset=utf-8",
    hdrs.CACHE_CONTROL: "no-cache",
    "X-Accel-Buffering": "no",
}
UPSTREAM_MESSAGE_LIMIT = 2000


async def upstream_error(
    upstream: aiohttp.ClientResponse, slot: str, timeout_s: float
) -> UpstreamStatus:
    """The upstream's error status and message, kept, for Anthropic's error envelope."""
    raw = await read_whole(upstream, slot, timeout_s)
    message = raw.decode("utf-8", "replace").strip()
    try:
        parsed = orjson.loads(raw)
    except orjson.JSONDecodeError:
        parsed = None
    if isinstance(parsed, dict):
        error = parsed.get("error", parsed)
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            message = error["message"]
        elif isinstance(error, str):
            message = error
    # Some servers put their Python traceback in the message; the client gets the message only.
    message = message.split('\n  File "', 1)[0].strip()
    message = message[:UPSTREAM_MESSAGE_LIMIT] or f"upstream answered {upstream.status}"
    return UpstreamStatus(upstream.status, f"slot {slot!r}: {message}")


async def messages(request: web.Request) -> web.StreamResponse:
    info = request[INFO]
    runtime = request.app[RUNTIME].current
    req = parse_messages_request(parse_json_object(await read_body(request)))
    info.model, info.stream = req.model, req.stream
    route = runtime.router.resolve(req.model)
    payload = to_openai(
        req, served_model=route.served_model, max_output_tokens=route.slot.max_output_tokens
    )
    info.served_model, info.slot = route.served_model, route.slot.name
    timeouts = route.slot.timeouts(runtime.config.dispatcher)
    session = request.app[SESSION]

    async with request.app[SLOTS].lease(route.slot.name) as lease:
        info.queue_ms = lease.queue_ms
        input_tokens = None
        if req.stream:
            input_tokens, _ = await request.app[TOKEN_COUNTER].count(
                route.slot, payload, prompt_text(payload)
            )
        headers = request_headers(request.headers, route.slot)
        headers[hdrs.CONTENT_TYPE] = "application/json"
        upstream = await open_upstream(
            session,
            route.slot,
            timeouts,
            method=hdrs.METH_POST,
            path="/v1/chat/completions",
            headers=headers,
            body=orjson.dumps(payload),
            guarded=req.stream and guard_active(timeouts),
            slot_reason=lease.slot.reason,
        )
        try:
            info.upstream_status(upstream.status)
            if upstream.status >= 400:
                raise await upstream_error(
                    upstream, route.slot.name, timeouts.direct_read_timeout_s
                )
            if not req.stream:
                return await answer_whole(upstream, req.model, req.stop_sequences, info, timeouts)
            if upstream.content_type != "text/event-stream":
                raise UpstreamInvalid(
                    f"slot {route.slot.name!r} answered a streaming request with "
                    f"content-type {upstream.content_type!r}, not text/event-stream"
                )
            translator = Translator(
                req.model, input_tokens=input_tokens, stop_sequences=req.stop_sequences
            )
            response = web.StreamResponse(status=200, headers=SSE_HEADERS)
            await stream_through(
                request,
                upstream,
                response,
                AnthropicTransform(translator),
                timeouts=timeouts,
                slot_name=route.slot.name,
            )
            if info.prompt_tokens is None:
                info.prompt_tokens = translator.input_tokens
            return response
        finally:
            release_upstream(upstream)


async def answer_whole(
    upstream: aiohttp.ClientResponse,
    model: str,
    stop_sequences: tuple[str, ...],
    info: RequestInfo,
    timeouts: DispatcherConfig,
) -> web.Response:
    raw = await read_whole(upstream, str(info.slot), timeouts.direct_read_timeout_s)
    try:
        parsed = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise UpstreamInvalid(f"slot {info.slot!r} answered with invalid JSON") from None
    message = to_anthropic(parsed, model=model, stop_sequences=stop_sequences)
    info.apply_usage(
        {
            "prompt_tokens": message["usage"]["input_tokens"],
            "completion_tokens": message["usage"]["output_tokens"],
        }
    )
    return web.Response(body=orjson.dumps(message), content_type="application/json")


async def count_tokens(request: web.Request) -> web.Response:
    info = request[INFO]
    runtime = request.app[RUNTIME].current
    body = parse_json_object(await read_body(request))
    # count_tokens takes the Messages body without max_tokens; the parser requires one.
    body.setdefault("max_tokens", 1)
    body["stream"] = False
    req = parse_messages_request(body)
    route = runtime.router.resolve(req.model)
    info.model, info.served_model, info.slot = req.model, route.served_model, route.slot.name
    payload = to_openai(req, served_model=route.served_model)
    # Under a lease like any request: llama-cpp-python's server interrupts a running
    # completion when another request reaches it.
    async with request.app[SLOTS].lease(route.slot.name) as lease:
        info.queue_ms = lease.queue_ms
        count, source = await request.app[TOKEN_COUNTER].count(
            route.slot, payload, prompt_text(payload)
        )
    info.prompt_tokens = count
    return web.Response(
        body=orjson.dumps({"input_tokens": count}),
        content_type="application/json",
        headers={"X-Hal0d-Token-Count": source},
    )
