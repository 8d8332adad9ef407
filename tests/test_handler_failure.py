"""A handler that fails after its answer's head is out (a stream half written) cannot be answered
with an error envelope: the connection is cut, so the client sees the stream break instead of
waiting for a rest that never comes, and no second head is written into the first one's body.
Found by the bench: a relay that raised mid-stream left its client waiting for good. Real sockets;
the failing handler is a route of the test's own, mounted beside hal0d's in the same app."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from structlog.testing import capture_logs

from hal0d.app import make_app
from tests.harness.config import make_config
from tests.harness.poll import eventually


async def fails_mid_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(b'data: {"choices": []}\n\n')
    raise RuntimeError("a bug of hal0d's after the first chunk")


async def fails_before_anything(_: web.Request) -> web.StreamResponse:
    raise RuntimeError("a bug of hal0d's before any byte")


@pytest.fixture
async def hal0d(aiohttp_server: Callable[..., Awaitable[TestServer]],
                tmp_path: Path) -> TestServer:
    app = make_app(make_config("http://127.0.0.1:9", tmp_path=tmp_path))
    app.router.add_post("/v1/test/mid-stream", fails_mid_stream)
    app.router.add_post("/v1/test/before", fails_before_anything)
    return await aiohttp_server(app)


async def test_a_handler_that_fails_mid_stream_cuts_the_connection_and_logs_it(
    hal0d: TestServer, http: aiohttp.ClientSession
) -> None:
    with capture_logs() as logs:
        async with http.post(hal0d.make_url("/v1/test/mid-stream")) as resp:
            assert resp.status == 200
            first = await resp.content.readany()
            assert first.startswith(b"data: ")
            with pytest.raises(aiohttp.ClientPayloadError):
                async with asyncio.timeout(5):  # a bound, not a speed: it used to wait forever
                    await resp.read()
        done = await eventually(lambda: next(e for e in logs if e["event"] == "request.done"),
                                2, "the request's request.done line")
    assert [e["event"] for e in logs if e["event"] == "request.failed"] == ["request.failed"]
    assert (done["status"], done["ok"], done["error_code"]) == (200, False, "internal")


async def test_a_handler_that_fails_before_any_byte_still_answers_500_in_the_envelope(
    hal0d: TestServer, http: aiohttp.ClientSession
) -> None:
    async with http.post(hal0d.make_url("/v1/test/before")) as resp:
        assert resp.status == 500
        error = (await resp.json())["error"]
    assert error["message"] == "internal error in hal0d; see its log"
