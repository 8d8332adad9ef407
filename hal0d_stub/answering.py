"""How an endpoint sends its answer, or misbehaves in its place as the model name asks: a whole
answer (`stall` and `chatty` never send it, `broken` cuts it off halfway), the response of an SSE
stream, the pause before each token, and a stream's `stall` or `broken` once its first few tokens
are out.
"""

from __future__ import annotations

import asyncio

from aiohttp import hdrs, web

from hal0d_stub.appkeys import LOG_KEY

# The models that misbehave in the middle of a stream, after TOKENS_BEFORE_TROUBLE tokens (or
# audio frames).
MID_STREAM_TROUBLE = frozenset({"stall", "broken"})
TOKENS_BEFORE_TROUBLE = 3


async def pause(delay: float) -> None:
    # Yield to the loop even without pacing so cancellation and other requests get a turn.
    await asyncio.sleep(delay)


async def misbehave_mid_stream(request: web.Request, model: str, what: str) -> bool:
    """`stall` goes silent for good; `broken` cuts the connection (True: the answer is over)."""
    log = request.app[LOG_KEY]
    if model == "stall":
        log.write(f"stalling {what}")
        await asyncio.Event().wait()  # silence until the client goes away
    if model == "broken":
        log.write(f"breaking {what}")
        assert request.transport is not None
        request.transport.abort()
        return True
    return False


def sse_response() -> web.StreamResponse:
    return web.StreamResponse(
        headers={hdrs.CONTENT_TYPE: "text/event-stream", hdrs.CACHE_CONTROL: "no-cache"}
    )


async def answer_whole(
    request: web.Request,
    model: str,
    body: bytes,
    content_type: str = "application/json",
) -> web.StreamResponse:
    """A non-streamed answer, or the model's misbehaviour in its place: `stall` and `chatty`
    never answer, `broken` sends the headers and half the body, then cuts the connection."""
    log = request.app[LOG_KEY]
    if model in ("stall", "chatty"):
        log.write(f"stalling model={model} (no answer)")
        await asyncio.Event().wait()  # silence until the client goes away
    if model != "broken":
        return web.Response(body=body, content_type=content_type)
    response = web.StreamResponse(headers={hdrs.CONTENT_TYPE: content_type})
    response.content_length = len(body)
    await response.prepare(request)
    await response.write(body[: len(body) // 2])
    log.write(f"breaking model={model} after {len(body) // 2} of {len(body)} bytes")
    assert request.transport is not None
    request.transport.abort()
    return response
