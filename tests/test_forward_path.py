"""The one forward path (hal0d/forward/) and the one transport boundary (upstream_errors), over
real sockets: every surface and endpoint takes the slot through the same lease and gives it back
on every exit, and a failure to reach an upstream reads the same wherever it happens."""

from __future__ import annotations

import asyncio
import errno
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from structlog.testing import capture_logs

from hal0d.config import SlotConfig
from hal0d.errors import FdExhausted, UpstreamInvalid, UpstreamUnavailable
from hal0d.lifecycle.probe import probe
from hal0d.transport import descriptors
from hal0d.transport.failures import upstream_errors
from hal0d.transport.upstream import UpstreamClient
from tests.harness.client import chat_body
from tests.harness.poll import eventually
from tests.harness.ports import free_port

MESSAGES = {"model": "chat", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
SETTLE_S = 5.0


async def slot_view(http: aiohttp.ClientSession, hal0d: Any) -> dict[str, Any]:
    async with http.get(hal0d.make_url("/api/slots")) as resp:
        view: dict[str, Any] = (await resp.json())["slots"][0]
        return view


async def until_slot(http: aiohttp.ClientSession, hal0d: Any, what: str, **expected: int) -> None:
    deadline = asyncio.get_running_loop().time() + SETTLE_S
    while True:
        view = await slot_view(http, hal0d)
        if all(view[key] == value for key, value in expected.items()):
            return
        assert asyncio.get_running_loop().time() < deadline, f"{what}: {view}"
        await asyncio.sleep(0.02)


async def test_count_tokens_waits_for_the_slot_like_every_other_request(
    upstream_app, start_hal0d, http
):
    """count_tokens goes through the same lease as a generation: with the slot's one place
    taken by a stream, the count queues, and is answered once the stream ends."""
    streaming = asyncio.Event()
    finish = asyncio.Event()

    async def chat(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices":[]}\n\n')
        streaming.set()
        await finish.wait()
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def tokenize(_: web.Request) -> web.Response:
        return web.json_response({"count": 7})

    url = await upstream_app({"POST /v1/chat/completions": chat, "POST /tokenize": tokenize})
    hal0d = await start_hal0d(url, slot={"max_concurrent": 1})

    async def stream() -> bytes:
        async with http.post(hal0d.make_url("/v1/chat/completions"), json=chat_body()) as resp:
            return await resp.read()

    async def count() -> tuple[dict[str, Any], str]:
        async with http.post(hal0d.make_url("/v1/messages/count_tokens"), json=MESSAGES) as resp:
            assert resp.status == 200
            return await resp.json(), resp.headers["X-Hal0d-Token-Count"]

    held = asyncio.create_task(stream())
    await asyncio.wait_for(streaming.wait(), SETTLE_S)
    counted = asyncio.create_task(count())
    await until_slot(http, hal0d, "the count queued behind the stream", in_flight=1, queued=1)
    assert not counted.done()
    finish.set()
    assert (await held).endswith(b"data: [DONE]\n\n")
    assert await counted == ({"input_tokens": 7}, "tokenize")
    await until_slot(http, hal0d, "every lease given back", in_flight=0, queued=0)


async def test_an_upstream_error_status_gives_back_the_lease_on_the_anthropic_surface(
    upstream_app, start_hal0d, http
):
    """An error status raised from inside the forward block still releases the upstream and
    the lease: with one place on the slot, request after request gets the upstream's error."""

    async def chat(_: web.Request) -> web.Response:
        return web.json_response({"message": "model is warming up"}, status=503)

    url = await upstream_app({"POST /v1/chat/completions": chat})
    hal0d = await start_hal0d(url, slot={"max_concurrent": 1, "max_queue": 0})
    for stream in (False, True, False):
        async with http.post(
            hal0d.make_url("/v1/messages"), json={**MESSAGES, "stream": stream}
        ) as resp:
            assert resp.status == 503
            body = await resp.json()
        assert body["error"]["type"] == "overloaded_error"
        assert body["error"]["message"] == "slot 'llm': model is warming up"
    await until_slot(http, hal0d, "every lease given back", in_flight=0, queued=0)


@pytest.mark.parametrize(
    "answer",
    [
        pytest.param(b"this is not json", id="invalid JSON"),
        pytest.param(b'{"id": "x", "choices": []}', id="malformed completion"),
    ],
)
async def test_invalid_json_and_a_malformed_completion_are_the_same_error(
    answer: bytes, upstream_app, start_hal0d, http
):
    """Both are an upstream that answered with nothing usable: 502 `upstream_invalid`."""

    async def chat(_: web.Request) -> web.Response:
        return web.Response(body=answer, content_type="application/json")

    url = await upstream_app({"POST /v1/chat/completions": chat})
    hal0d = await start_hal0d(url)
    with capture_logs() as events:
        async with http.post(hal0d.make_url("/v1/messages"), json=MESSAGES) as resp:
            assert resp.status == 502
            body = await resp.json()
        done = await eventually(
            lambda: [e for e in events if e["event"] == "request.done"], 2.0, "request.done"
        )
    assert body["error"]["type"] == "api_error"
    assert [e["error_code"] for e in done] == ["upstream_invalid"]


async def test_a_refused_connect_reads_the_same_in_a_request_and_in_the_probe(
    start_hal0d, http
):
    """The transport reason is worded in one place: a request's 502 and the probe's slot
    reason name the same cause."""
    dead = f"http://127.0.0.1:{free_port()}"
    slot = SlotConfig(name="llm", upstream=dead, models=("chat",))
    async with aiohttp.ClientSession() as session:
        reason = await probe(UpstreamClient(session), slot)
    assert reason == "cannot connect (connection refused)"
    hal0d = await start_hal0d(dead)
    with capture_logs() as logs:
        async with http.post(hal0d.make_url("/v1/chat/completions"), json=chat_body()) as resp:
            assert resp.status == 502
            body = await resp.json()
    assert body["error"]["code"] == "dispatch.upstream_unavailable"
    # hal0d's own probe found the slot in error before the request: the message says so too.
    assert body["error"]["message"] == (
        f"slot 'llm' is unavailable: {reason}; the slot is in error: {reason}"
    )
    # The address is the operator's: in the log line, with the exception's own text.
    [logged] = [entry for entry in logs if entry["event"] == "upstream.unavailable"]
    assert logged["slot"] == "llm" and logged["upstream"] == dead
    assert logged["reason"] == reason and dead.removeprefix("http://") in logged["error"]


SLOT = SlotConfig(name="llm", upstream="http://127.0.0.1:9", models=("chat",))


async def test_no_descriptor_left_is_fd_exhausted_only_on_a_requests_behalf(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """EMFILE while opening for a request is hal0d's capacity (503, counted); for the probe,
    which counts no refusal, it is a reason like any other."""
    monkeypatch.setattr(descriptors, "report", descriptors.ExhaustionReport())
    # aiohttp's client reports the socket's EMFILE as one of its OSErrors.
    with pytest.raises(FdExhausted), upstream_errors(SLOT, "connecting", refused_at="test"):
        raise aiohttp.ClientOSError(errno.EMFILE, "Too many open files")
    with pytest.raises(UpstreamUnavailable) as caught, upstream_errors(SLOT, "connecting"):
        raise aiohttp.ClientOSError(errno.EMFILE, "Too many open files")
    assert not isinstance(caught.value, FdExhausted)
    assert descriptors.report.refused_total == 1
    assert caught.value.message == "slot 'llm' is unavailable: too many open files connecting"


def test_the_boundary_maps_transport_errors_only() -> None:
    """A timeout becomes a 502 naming what was awaited; hal0d's own errors and a cancellation
    pass through untouched."""
    with pytest.raises(UpstreamUnavailable) as caught, upstream_errors(SLOT, "reading"):
        raise TimeoutError
    assert caught.value.message == "slot 'llm' is unavailable: timed out reading"
    invalid = UpstreamInvalid("not a completion")
    with pytest.raises(UpstreamInvalid) as passed, upstream_errors(SLOT, "reading"):
        raise invalid
    assert passed.value is invalid
    with pytest.raises(asyncio.CancelledError), upstream_errors(SLOT, "reading"):
        raise asyncio.CancelledError
    # A bug of hal0d's inside the block is not the upstream's failure: it is no 502.
    for bug in (ValueError("bad value"), OSError(errno.ENOENT, "No such file"), KeyError("k")):
        with pytest.raises(type(bug)), upstream_errors(SLOT, "reading"):
            raise bug
