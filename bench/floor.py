"""The floor: the least a proxy built on hal0d's stack does for one request, and nothing more.

    python -m bench.floor --port PORT --upstream http://127.0.0.1:UPSTREAM

One aiohttp route, POST /v1/chat/completions, forwarded over hal0d's own upstream session
(hal0d.transport.upstream.make_session: the same connector, timeouts and read size) on uvloop,
as `hal0d serve` runs: a whole answer read and written back, a stream's chunks written as they
come. No admission, no lease, no history, no metrics, no log line, no header filtering, no
checks of the body. The latency rows measure it beside hal0d, so "hal0d's own work" (hal0d's
CPU per request minus this) is a figure of the run, not a guess: what a change of hal0d's own
code can win back, and what only aiohttp, uvloop or the kernel could.
"""

from __future__ import annotations

import argparse
import asyncio

import uvloop
from aiohttp import web
from yarl import URL

from hal0d.config import DispatcherConfig
from hal0d.transport.upstream import make_session

CHAT = "/v1/chat/completions"


async def serve(port: int, upstream: str) -> None:
    session = make_session(DispatcherConfig())
    target = URL(upstream + CHAT)

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        async with session.post(target, data=body,
                                headers={"Content-Type": "application/json"}) as answer:
            if answer.content_type != "text/event-stream":
                return web.Response(body=await answer.read(), status=answer.status,
                                    content_type=answer.content_type)
            response = web.StreamResponse(status=answer.status,
                                          headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            async for chunk in answer.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def ready(_: web.Request) -> web.Response:  # the harness's wait, never measured
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post(CHAT, forward)
    app.router.add_get("/healthz", ready)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
        await session.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    args = parser.parse_args()
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(serve(args.port, args.upstream))


if __name__ == "__main__":
    main()
