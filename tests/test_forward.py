"""The forward path of the OpenAI surface, over real sockets: hal0d in front of an upstream."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import orjson
from aiohttp import hdrs, web
from multidict import CIMultiDict, CIMultiDictProxy

from hal0d.transport.upstream import response_headers
from tests.fixtures_util import fixture_path
from tests.harness.client import chat_body, read_http_chunks
from tests.harness.poll import eventually
from tests.harness.ports import free_port
from tests.harness.stubs import ROLE_CHUNK, content_chunk


def fixture_chunks() -> list[bytes]:
    """The real llama-cpp-python capture, split into events, some of them cut mid-line: the
    relay must not care where one read ends."""
    raw = fixture_path("llama-cpp-python-0.3.36-smollm2-stream.sse").read_bytes()
    events = [e + b"\n\n" for e in raw.split(b"\n\n") if e]
    pieces = []
    for index, event in enumerate(events):
        if index % 3 == 1:
            pieces += [event[:17], event[17:]]
        else:
            pieces.append(event)
    return pieces


async def test_stream_is_relayed_byte_for_byte_with_its_chunk_boundaries(
    upstream_app, start_hal0d, http
):
    pieces = fixture_chunks()

    async def upstream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={hdrs.CONTENT_TYPE: "text/event-stream; charset=utf-8"}
        )
        await response.prepare(request)
        for piece in pieces:
            await response.write(piece)
            await asyncio.sleep(0.03)  # keep the reads apart so each piece is its own chunk
        await response.write_eof()
        return response

    url = await upstream_app({"POST /v1/chat/completions": upstream})
    hal0d = await start_hal0d(url)
    async with http.post(hal0d.make_url("/v1/chat/completions"), json=chat_body()) as resp:
        assert resp.status == 200
        assert resp.headers[hdrs.CONTENT_TYPE] == "text/event-stream; charset=utf-8"
        assert resp.headers[hdrs.CACHE_CONTROL] == "no-cache"
        assert resp.headers["X-Accel-Buffering"] == "no"
        received = await read_http_chunks(resp)
    assert received == pieces
    assert b"".join(received).endswith(b"data: [DONE]\n\n")


async def test_the_stub_streams_through_hal0d(stub, start_hal0d, http):
    hal0d = await start_hal0d(stub.url)
    body = chat_body("reasoning", stream_options={"include_usage": True})
    async with http.post(hal0d.make_url("/v1/chat/completions"), json=body) as resp:
        raw = await resp.read()
    events = [e for e in raw.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    chunks = [orjson.loads(e[len(b"data: ") :]) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    kinds = [next(iter(c["choices"][0]["delta"]), None) for c in chunks[1:-2]]
    assert kinds[0] == "reasoning_content" and kinds[-1] == "content"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(kinds)


async def test_status_and_content_type_copy_through(upstream_app, start_hal0d, http):
    answers = {
        "ok": (200, "application/json", b'{"id":"x","choices":[]}'),
        "busy": (429, "application/json", b'{"error":{"message":"slow down"}}'),
        "bad": (500, "text/plain", b"upstream exploded"),
    }

    async def upstream(request: web.Request) -> web.Response:
        status, content_type, body = answers[(await request.json())["model"]]
        return web.Response(status=status, body=body, headers={hdrs.CONTENT_TYPE: content_type})

    url = await upstream_app({"POST /v1/chat/completions": upstream})
    hal0d = await start_hal0d(url, models=tuple(answers))
    for model, (status, content_type, body) in answers.items():
        for stream in (False, True):
            async with http.post(
                hal0d.make_url("/v1/chat/completions"), json=chat_body(model, stream=stream)
            ) as resp:
                assert resp.status == status, (model, stream)
                assert resp.headers[hdrs.CONTENT_TYPE] == content_type
                assert await resp.read() == body


async def test_dead_upstream_is_a_clean_502_within_the_connect_timeout(start_hal0d, http):
    dead = f"http://127.0.0.1:{free_port()}"
    hal0d = await start_hal0d(dead, dispatcher={"connect_timeout_s": 2.0})
    started = time.monotonic()
    async with http.post(hal0d.make_url("/v1/chat/completions"), json=chat_body()) as resp:
        body = await resp.json()
        assert resp.status == 502
    assert time.monotonic() - started < 2.0
    assert body["error"]["type"] == "upstream_unavailable"
    assert body["error"]["code"] == "dispatch.upstream_unavailable"
    assert "'llm'" in body["error"]["message"]


async def test_client_disconnect_closes_the_upstream_within_a_second(stub, start_hal0d, http):
    hal0d = await start_hal0d(stub.url)
    body = chat_body("reasoning", content="long", max_tokens=100_000)
    resp = await http.post(hal0d.make_url("/v1/chat/completions"), json=body)
    await resp.content.readline()  # the stream is flowing
    resp.close()  # the client goes away mid-stream
    def cancelled() -> bool:
        assert any("cancelled" in line for line in stub.lines()), stub.lines()
        return True

    await eventually(cancelled, 1.0, "the stub's generation cancelled")


async def test_unknown_model_is_404_listing_served_models(stub, start_hal0d, http):
    hal0d = await start_hal0d(stub.url)
    async with http.post(hal0d.make_url("/v1/chat/completions"), json=chat_body("gpt-9")) as resp:
        body = await resp.json()
    assert resp.status == 404
    assert body["error"]["code"] == "dispatch.no_route"
    assert "'gpt-9'" in body["error"]["message"] and "reasoning" in body["error"]["message"]


async def test_malformed_json_and_missing_model_are_400(stub, start_hal0d, http):
    hal0d = await start_hal0d(stub.url)
    for data in (b"{not json", b"[1, 2]", b'{"messages": []}', b'{"model": 7}'):
        async with http.post(hal0d.make_url("/v1/chat/completions"), data=data) as resp:
            body = await resp.json()
        assert resp.status == 400, data
        assert body["error"]["type"] == "invalid_request_error"


def test_hop_by_hop_headers_of_an_answer_and_those_its_connection_names_stay_behind() -> None:
    upstream = CIMultiDictProxy(CIMultiDict([
        ("Connection", "keep-alive, X-Upstream-Private"), ("Keep-Alive", "timeout=5"),
        ("x-upstream-private", "hop"), ("Transfer-Encoding", "chunked"), ("Date", "today"),
        ("Server", "llama"), ("Content-Type", "text/event-stream"), ("Set-Cookie", "a=1"),
        ("Set-Cookie", "b=2"), ("X-Request-Id", "up-1"),
    ]))
    out = response_headers(upstream)
    assert list(out.items()) == [
        ("Content-Type", "text/event-stream"), ("Set-Cookie", "a=1"), ("Set-Cookie", "b=2"),
        ("X-Request-Id", "up-1"), ("Cache-Control", "no-cache"), ("X-Accel-Buffering", "no"),
    ]


async def test_credentials_and_hop_by_hop_headers_are_not_forwarded(
    upstream_app, start_hal0d, http
):
    seen: dict[str, str] = {}

    async def upstream(request: web.Request) -> web.Response:
        seen.update(request.headers)
        return web.json_response(
            {"choices": []}, headers={"Keep-Alive": "timeout=5", "X-Upstream": "yes"}
        )

    url = await upstream_app({"POST /v1/chat/completions": upstream})
    hal0d = await start_hal0d(url, slot={"api_key": "slot-secret"})
    headers = {
        "Authorization": "Bearer client-secret",
        "x-api-key": "client-secret",
        "Connection": "keep-alive, X-Private",
        "X-Private": "hop",
        "X-Custom": "kept",
    }
    async with http.post(
        hal0d.make_url("/v1/chat/completions"), json=chat_body(stream=False), headers=headers
    ) as resp:
        assert resp.status == 200
        assert resp.headers["X-Upstream"] == "yes"
        assert "Keep-Alive" not in resp.headers
    assert seen["Authorization"] == "Bearer slot-secret"
    assert "x-api-key" not in {k.lower() for k in seen}
    assert "X-Private" not in seen
    assert seen["X-Custom"] == "kept"


async def test_every_endpoint_is_dispatched_under_both_prefixes(stub, start_hal0d, http):
    hal0d = await start_hal0d(stub.url)
    for prefix in ("/v1", "/llm/v1"):
        async with http.post(
            hal0d.make_url(f"{prefix}/embeddings"), json={"model": "chat", "input": ["a", "b"]}
        ) as resp:
            assert resp.status == 200
            assert len((await resp.json())["data"]) == 2
        async with http.post(
            hal0d.make_url(f"{prefix}/completions"),
            json={"model": "chat", "prompt": "x", "stream": True},
        ) as resp:
            raw = await resp.read()
            assert b'"object":"text_completion"' in raw and raw.endswith(b"data: [DONE]\n\n")
        async with http.post(
            hal0d.make_url(f"{prefix}/audio/speech"), json={"model": "chat", "input": "x"}
        ) as resp:
            assert resp.headers[hdrs.CONTENT_TYPE] == "audio/wav"
            assert len(await resp.read()) == 8 * 1024
        async with http.get(hal0d.make_url(f"{prefix}/models")) as resp:
            ids = {m["id"] for m in (await resp.json())["data"]}
            assert {"reasoning", "chat", "broken"} <= ids


async def test_transcription_model_comes_from_the_multipart_form(upstream_app, start_hal0d, http):
    async def upstream(request: web.Request) -> web.Response:
        form = await request.post()
        return web.json_response(
            {"text": f"model={form['model']} bytes={len(form['file'].file.read())}"}
        )

    url = await upstream_app({"POST /v1/audio/transcriptions": upstream})
    hal0d = await start_hal0d(url, models=("whisper",))
    form = aiohttp.FormData()
    form.add_field("model", "whisper")
    form.add_field("file", b"\x00" * 1000, filename="a.wav", content_type="audio/wav")
    async with http.post(hal0d.make_url("/v1/audio/transcriptions"), data=form) as resp:
        assert resp.status == 200
        assert (await resp.json())["text"] == "model=whisper bytes=1000"


async def test_an_alias_reaches_the_served_model(stub, start_hal0d, http):
    hal0d = await start_hal0d(stub.url, aliases={"gpt-*": "chat"})
    async with http.post(
        hal0d.make_url("/v1/chat/completions"), json=chat_body("gpt-4o", stream=False)
    ) as resp:
        body = await resp.json()
    assert resp.status == 200
    assert body["model"] == "chat"  # the upstream was asked for the served name


async def test_wrong_method_is_405_in_the_envelope(stub, start_hal0d, http):
    hal0d = await start_hal0d(stub.url)
    async with http.get(hal0d.make_url("/v1/chat/completions")) as resp:
        body = await resp.json()
    assert resp.status == 405
    assert body["error"]["code"] == "request.method_not_allowed"


async def test_healthz_answers_while_serving(stub, start_hal0d, http):
    hal0d = await start_hal0d(stub.url)
    async with http.get(hal0d.make_url("/healthz")) as resp:
        assert resp.status == 200
        assert (await resp.json())["status"] == "ok"


async def test_header_wait_of_a_guarded_stream_is_bounded_by_direct_read_timeout_alone(
    upstream_app, start_hal0d, http
):
    async def slow_headers(request: web.Request) -> web.Response:
        await asyncio.sleep(5)  # an upstream slow to answer: the behaviour under test
        return web.Response(text="late")

    url = await upstream_app({"POST /v1/chat/completions": slow_headers})
    # Default pool, connect and write timeouts (5 + 5 + 10 s) must not stretch the header wait.
    hal0d = await start_hal0d(url, dispatcher={"direct_read_timeout_s": 0.5})
    started = time.monotonic()
    async with http.post(hal0d.make_url("/v1/chat/completions"), json=chat_body()) as resp:
        body = await resp.json()
    elapsed = time.monotonic() - started
    assert resp.status == 502
    assert "response headers" in body["error"]["message"]
    assert 0.5 <= elapsed < 1.5


async def test_an_upstream_that_stalls_inside_an_answer_it_did_not_stream_is_a_clean_502(
    upstream_app, start_hal0d, http
):
    """Stream requests answered with a whole body (or an error status) that then stalls or
    breaks: the body read is bounded and mapped, never a hang or a 500."""

    async def stalled_body(request: web.Request) -> web.StreamResponse:
        status = 500 if (await request.json())["model"] == "broken" else 200
        response = web.StreamResponse(
            status=status, headers={hdrs.CONTENT_TYPE: "application/json",
                                    hdrs.CONTENT_LENGTH: "100"}
        )
        await response.prepare(request)
        await response.write(b'{"error":')  # 9 of the 100 bytes promised, then nothing
        await asyncio.sleep(30)  # the body stalls: the behaviour under test
        return response

    url = await upstream_app({"POST /v1/chat/completions": stalled_body})
    hal0d = await start_hal0d(url, dispatcher={"direct_read_timeout_s": 0.5})
    cases = (
        ("/v1/chat/completions", chat_body()),
        ("/llm/v1/messages", {"model": "broken", "max_tokens": 8, "stream": True,
                              "messages": [{"role": "user", "content": "hi"}]}),
        ("/llm/v1/messages", {"model": "broken", "max_tokens": 8,
                              "messages": [{"role": "user", "content": "hi"}]}),
    )
    for path, body in cases:
        started = time.monotonic()
        async with http.post(hal0d.make_url(path), json=body) as resp:
            answer = await resp.text()
        assert resp.status == 502, (path, answer)
        assert "Traceback" not in answer
        assert time.monotonic() - started < 2.0
    async with http.get(hal0d.make_url("/api/slots")) as resp:
        assert (await resp.json())["slots"][0]["in_flight"] == 0


async def test_an_alias_reaches_a_transcription_upstream_as_the_served_name(
    upstream_app, start_hal0d, http
):
    audio = bytes(range(256)) * 40  # binary, with bytes that look like CR and LF

    async def upstream(request: web.Request) -> web.Response:
        form = await request.post()
        return web.json_response(
            {"model": form["model"], "intact": form["file"].file.read() == audio}
        )

    url = await upstream_app({"POST /v1/audio/transcriptions": upstream})
    hal0d = await start_hal0d(url, models=("whisper",), aliases={"whisper-*": "whisper"})
    form = aiohttp.FormData()
    form.add_field("model", "whisper-1")
    form.add_field("file", audio, filename="a.wav", content_type="audio/wav")
    async with http.post(hal0d.make_url("/v1/audio/transcriptions"), data=form) as resp:
        assert resp.status == 200
        assert await resp.json() == {"model": "whisper", "intact": True}


async def test_a_cookie_one_client_got_from_the_upstream_never_reaches_it_for_another(
    upstream_app, start_hal0d, http
):
    """hal0d's one upstream session keeps no cookies: a Set-Cookie relayed to one client is that
    client's, never sent upstream again on another client's request."""
    seen: list[str | None] = []

    async def upstream(request: web.Request) -> web.Response:
        seen.append(request.headers.get(hdrs.COOKIE))
        response = web.json_response({"id": "x", "choices": []})
        response.set_cookie("session", "alice-secret-session")
        return response

    # By name, not by address: aiohttp's default cookie jar ignores cookies of IP addresses, and
    # a remote provider has a name.
    url = (await upstream_app({"POST /v1/chat/completions": upstream})).replace(
        "127.0.0.1", "localhost"
    )
    hal0d = await start_hal0d(url, models=("chat",))
    for _ in range(2):
        # Two clients, each with a session of its own: they share no cookie jar.
        async with aiohttp.ClientSession() as client, client.post(
            hal0d.make_url("/v1/chat/completions"), json=chat_body("chat", stream=False)
        ) as resp:
            assert resp.status == 200
            assert "alice-secret-session" in resp.headers.get(hdrs.SET_COOKIE, "")
    assert seen == [None, None]


async def history_rows(http: aiohttp.ClientSession, hal0d) -> list[dict]:
    async with http.get(hal0d.make_url("/api/requests?limit=10")) as resp:
        return (await resp.json())["requests"]


async def test_a_client_that_closes_on_reading_the_terminal_frame_has_a_finished_request(
    upstream_app, start_hal0d, http
):
    """The openai SDK closes its connection as soon as it reads `data: [DONE]`, often before the
    upstream ends its body; the Anthropic SDK does the same on message_stop. The answer was
    whole: the row says ok, not client_disconnect. A client that leaves before the terminal
    frame is still a disconnect."""
    held = asyncio.Event()

    async def upstream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={hdrs.CONTENT_TYPE: "text/event-stream"})
        await response.prepare(request)
        await response.write(ROLE_CHUNK + content_chunk("hello"))
        if (await request.json()).get("messages", [{}])[0].get("content") != "leave early":
            await response.write(
                b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
                b"data: [DONE]\n\n"
            )
        held.set()
        await asyncio.sleep(5)  # the body stays open past the terminal frame
        return response

    url = await upstream_app({"POST /v1/chat/completions": upstream})
    hal0d = await start_hal0d(url, models=("chat",))
    ends = {
        "openai": ("/v1/chat/completions", chat_body("chat"), b"data: [DONE]"),
        "anthropic": ("/v1/messages", {"model": "chat", "max_tokens": 16, "stream": True,
                                       "messages": [{"role": "user", "content": "hi"}]},
                      b"event: message_stop"),
        "early": ("/v1/chat/completions", chat_body("chat", content="leave early"), b"hello"),
    }
    for path, body, last in ends.values():
        held.clear()
        async with http.post(hal0d.make_url(path), json=body) as resp:
            seen = b""
            while last not in seen:
                chunk = await resp.content.readany()
                assert chunk, (path, seen)  # the end of the body before the frame: a failure
                seen += chunk
            await held.wait()
            resp.connection.transport.abort()  # closes at once, with the upstream still open

    async def three_rows() -> list[dict]:
        rows = await history_rows(http, hal0d)
        return rows if len(rows) == 3 else []

    early, anthropic, openai = await eventually(three_rows, 5, "three history rows")
    assert (openai["ok"], openai["error_code"]) == (True, None), openai
    assert (anthropic["ok"], anthropic["error_code"]) == (True, None), anthropic
    assert (early["ok"], early["error_code"]) == (False, "client_disconnect"), early
