"""Hostile upstreams, table-driven, on both surfaces: the OpenAI passthrough stream on
/v1/chat/completions and the Anthropic stream on /llm/v1/messages.

For every case the client's stream ends with a clean terminal frame or error, the history row says
ok = 0 with the exact error_code, the slot is released, and hal0d serves the next request.

The OpenAI passthrough relays the upstream's bytes verbatim by design: it does not parse the
chunks, so invalid JSON or invalid UTF-8 inside a data line reaches the client exactly as the
upstream sent it (and the row is ok = 1: hal0d saw a complete stream ending in [DONE]). For those
cases the passthrough is held to byte-exact delivery instead of an error.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Awaitable, Callable
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import hdrs, web
from aiohttp.test_utils import TestServer

from tests.anthropic_rules import assemble, assert_valid_anthropic_stream, events_from_sse

PASSTHROUGH = "/v1/chat/completions"
ANTHROPIC = "/llm/v1/messages"
IDLE_S = 0.3


def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    payload = {"id": "chatcmpl-h", "object": "chat.completion.chunk", "created": 0, "model": "m",
               "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + orjson.dumps(payload) + b"\n\n"


ROLE = chunk({"role": "assistant", "content": None})
HELLO = chunk({"content": "Hello"})
FINISH = chunk({}, "stop")
DONE = b"data: [DONE]\n\n"
# 3 MiB in one data line, with multi-byte characters so a cut inside one would show.
BIG_TEXT = ("hal0d é 🙂 " * (3 * 1024 * 1024 // 14 + 1))[: 3 * 1024 * 1024]
BIG = chunk({"content": BIG_TEXT})
HALF_EVENT = b'data: {"id":"chatcmpl-h","choices":[{"index":0,"delta":{"content":"hal'
WHOLE_ANSWER = {
    "id": "chatcmpl-h", "object": "chat.completion", "created": 0, "model": "m",
    "choices": [{"index": 0, "finish_reason": "stop",
                 "message": {"role": "assistant", "content": "Hello"}}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}

Respond = Callable[[web.Request], Awaitable[web.StreamResponse]]


def sse(*pieces: bytes, end: str = "eof", content_type: str = "text/event-stream") -> Respond:
    """An upstream that writes `pieces` as separate writes, then ends: `eof` (a clean end),
    `abort` (the connection is reset) or `hang` (it stays open and silent)."""

    async def respond(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={hdrs.CONTENT_TYPE: content_type})
        await response.prepare(request)
        for piece in pieces:
            await response.write(piece)
            await asyncio.sleep(0.005)
        if end == "abort":
            assert request.transport is not None
            request.transport.abort()
            return response
        if end == "hang":
            await asyncio.Event().wait()
        await response.write_eof()
        return response

    return respond


def whole(body: bytes, content_type: str | None = "application/json") -> Respond:
    async def respond(request: web.Request) -> web.StreamResponse:
        response = web.Response(body=body)
        if content_type is None:
            response.headers.pop(hdrs.CONTENT_TYPE, None)
        else:
            response.headers[hdrs.CONTENT_TYPE] = content_type
        return response

    return respond


@dataclass(frozen=True)
class Expect:
    """What one surface must show. `ending`:

    passthrough: verbatim (exactly the upstream's bytes), error_event (the upstream's bytes, then
    one `data: {"error": ...}` event whose code is dispatch.<error_code>), stall (the stall frame
    and [DONE]), envelope (a 502 OpenAI error envelope, code dispatch.<error_code>), refused
    (either of the last two: how hal0d refuses an unusable answer is its choice).
    anthropic: success (message_stop), error (a valid stream ending in one error event),
    envelope (a 502 with the Anthropic error body, before any stream).
    """

    ending: str
    error_code: str | None


@dataclass(frozen=True)
class Case:
    respond: Respond
    sent: bytes  # what the upstream writes before it ends (for byte-exact checks)
    passthrough: Expect
    anthropic: Expect
    stream: bool = True
    text: str | None = None  # the answer's text when the case must succeed


CASES: dict[str, Case] = {
    "invalid JSON in a data line": Case(
        sse(ROLE, HELLO, b'data: {"choices": [{"delta": {"content": "oops"\n\n', FINISH, DONE),
        ROLE + HELLO + b'data: {"choices": [{"delta": {"content": "oops"\n\n' + FINISH + DONE,
        Expect("verbatim", None), Expect("error", "upstream_malformed"),
    ),
    "invalid UTF-8 in a data line": Case(
        sse(ROLE, b'data: {"choices":[{"index":0,"delta":{"content":"\xff\xfe"}}]}\n\n', FINISH,
            DONE),
        ROLE + b'data: {"choices":[{"index":0,"delta":{"content":"\xff\xfe"}}]}\n\n' + FINISH
        + DONE,
        Expect("verbatim", None), Expect("error", "upstream_malformed"),
    ),
    "a 3 MiB data line": Case(
        sse(ROLE, BIG, FINISH, DONE), ROLE + BIG + FINISH + DONE,
        Expect("verbatim", None), Expect("success", None), text=BIG_TEXT,
    ),
    "no [DONE] after finish_reason": Case(
        sse(ROLE, HELLO, FINISH), ROLE + HELLO + FINISH,
        Expect("error_event", "upstream_incomplete"),
        # The Anthropic client gets the whole answer: finish_reason came, and [DONE] is only the
        # OpenAI framing, so message_stop is honest here and the row is ok. (The issue asks
        # ok = 0 for "no [DONE]"; this surface reads the finish_reason instead.)
        Expect("success", None), text="Hello",
    ),
    "no [DONE] and no finish_reason": Case(
        sse(ROLE, HELLO), ROLE + HELLO,
        Expect("error_event", "upstream_incomplete"), Expect("error", "upstream_incomplete"),
    ),
    "[DONE] without a finish_reason": Case(
        sse(ROLE, HELLO, DONE), ROLE + HELLO + DONE,
        # The passthrough only looks for [DONE]; it came.
        Expect("verbatim", None),
        Expect("error", "upstream_incomplete"),
    ),
    "connection reset in the middle of an event": Case(
        sse(ROLE, HELLO, HALF_EVENT, end="abort"), ROLE + HELLO + HALF_EVENT,
        Expect("error_event", "upstream_broken"), Expect("error", "upstream_broken"),
    ),
    "connection reset between events": Case(
        sse(ROLE, HELLO, end="abort"), ROLE + HELLO,
        Expect("error_event", "upstream_broken"), Expect("error", "upstream_broken"),
    ),
    "a JSON answer to a stream request (wrong content-type)": Case(
        whole(orjson.dumps(WHOLE_ANSWER)), orjson.dumps(WHOLE_ANSWER),
        # Status and content-type are the upstream's (the seed's rule), so the answer is relayed
        # as it came; that it is not the stream that was asked for shows in the row.
        Expect("verbatim", "upstream_invalid"),
        Expect("envelope", "upstream_invalid"),
    ),
    "a text/plain answer to a stream request (wrong content-type)": Case(
        sse(ROLE, HELLO, FINISH, DONE, content_type="text/plain"),
        ROLE + HELLO + FINISH + DONE,
        Expect("verbatim", "upstream_invalid"),
        Expect("envelope", "upstream_invalid"),
    ),
    "a 200 with an empty event stream": Case(
        sse(), b"", Expect("error_event", "upstream_incomplete"),
        Expect("error", "upstream_incomplete"),
    ),
    "a 200 with an empty body and no content-type": Case(
        whole(b"", None), b"",
        Expect("refused", "upstream_invalid"),
        Expect("envelope", "upstream_invalid"),
    ),
    "headers, then nothing": Case(
        sse(end="hang"), b"", Expect("stall", "stream_stall_idle"),
        Expect("error", "stream_stall_idle"),
    ),
    "headers and a first chunk, then nothing": Case(
        sse(ROLE, HELLO, end="hang"), ROLE + HELLO, Expect("stall", "stream_stall_idle"),
        Expect("error", "stream_stall_idle"),
    ),
    "a 200 with an empty body to a non-streaming request": Case(
        whole(b""), b"", Expect("envelope", "upstream_invalid"),
        Expect("envelope", "upstream_invalid"), stream=False,
    ),
    "invalid JSON to a non-streaming request": Case(
        whole(b'{"choices": [{"message": '), b'{"choices": [{"message": ',
        # Non-streaming OpenAI answers are relayed as they came, like streams.
        Expect("verbatim", None), Expect("envelope", "upstream_invalid"), stream=False,
    ),
}
MODELS = {name: f"hostile-{index}" for index, name in enumerate(CASES)}


def request_body(surface: str, model: str, stream: bool) -> dict[str, Any]:
    messages = [{"role": "user", "content": "hi"}]
    if surface == ANTHROPIC:
        return {"model": model, "max_tokens": 16, "stream": stream, "messages": messages}
    return {"model": model, "stream": stream, "messages": messages}


async def hostile_hal0d(upstream_app: Any, start_hal0d: Any) -> TestServer:
    by_model = {MODELS[name]: case.respond for name, case in CASES.items()}
    by_model["healthy"] = sse(ROLE, HELLO, FINISH, DONE)
    by_model["healthy-whole"] = whole(orjson.dumps(WHOLE_ANSWER))

    async def upstream(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        model = body["model"]
        if model == "healthy" and not body.get("stream"):
            model = "healthy-whole"
        return await by_model[model](request)

    url = await upstream_app({"POST /v1/chat/completions": upstream})
    return await start_hal0d(url, models=(*MODELS.values(), "healthy"),
                             dispatcher={"stream_idle_timeout_s": IDLE_S})


def history_row(path: Path, request_id: str) -> dict[str, Any] | None:
    if not path.exists():
        return None
    with closing(sqlite3.connect(path)) as conn:
        conn.row_factory = sqlite3.Row
        row = conn.execute("SELECT * FROM requests WHERE request_id = ?",
                           (request_id,)).fetchone()
    return dict(row) if row else None


async def wait_row(path: Path, request_id: str, timeout: float = 3.0) -> dict[str, Any] | None:
    deadline = time.monotonic() + timeout
    while (row := history_row(path, request_id)) is None and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return row


async def slots_idle(http: aiohttp.ClientSession, hal0d: TestServer, timeout: float = 2.0
                     ) -> list[dict[str, Any]] | None:
    """None once every slot is at in_flight 0 and queued 0; the snapshot if that never came."""
    deadline = time.monotonic() + timeout
    while True:
        async with http.get(hal0d.make_url("/api/slots")) as resp:
            slots = (await resp.json())["slots"]
        if all(s["in_flight"] == 0 and s["queued"] == 0 for s in slots):
            return None
        if time.monotonic() > deadline:
            return slots
        await asyncio.sleep(0.02)


def passthrough_problem(expect: Expect, case: Case, status: int, raw: bytes) -> str | None:
    if expect.ending == "refused":
        as_envelope = passthrough_problem(Expect("envelope", expect.error_code), case, status, raw)
        as_event = passthrough_problem(Expect("error_event", expect.error_code),
                                       Case(case.respond, b"", case.passthrough, case.anthropic),
                                       status, raw[raw.rfind(b"\n\ndata: "):])
        if as_envelope and as_event:
            return f"neither refusal: {as_envelope}; {as_event}"
        return None
    if expect.ending == "envelope":
        if status != 502:
            return f"status {status}, expected a 502 envelope: {raw[:200]!r}"
        error = orjson.loads(raw).get("error", {})
        if error.get("code") != f"dispatch.{expect.error_code}" or not error.get("message"):
            return f"not the dispatch.{expect.error_code} envelope: {raw[:300]!r}"
        return None
    if status != 200:
        return f"status {status}: {raw[:200]!r}"
    if expect.ending == "verbatim":
        if raw != case.sent:
            return f"not byte-exact: {len(raw)} bytes vs {len(case.sent)}, tail {raw[-120:]!r}"
        return None
    if not raw.startswith(case.sent):
        return f"the upstream's bytes were not relayed first: {raw[:200]!r}"
    tail = raw[len(case.sent):]
    if expect.ending == "error_event":
        if not (tail.startswith(b"\n\ndata: ") and tail.endswith(b"}\n\n")):
            return f"no error event after the upstream's bytes: {tail[:300]!r}"
        error = orjson.loads(tail[len(b"\n\ndata: "):-2])["error"]
        if error["code"] != f"dispatch.{expect.error_code}" or not error["message"]:
            return f"error event {error}, expected code dispatch.{expect.error_code}"
        return None
    assert expect.ending == "stall"
    if not (tail.startswith(b"\n\ndata: ") and tail.endswith(b"\n\ndata: [DONE]\n\n")):
        return f"no stall frame and [DONE]: {tail[:300]!r}"
    frame = orjson.loads(tail[len(b"\n\ndata: "):-len(b"\n\ndata: [DONE]\n\n")])
    if frame["x_hal0_stall"]["reason"] != "idle" or frame["choices"][0]["finish_reason"] is None:
        return f"not an idle stall frame: {frame}"
    return None


def anthropic_problem(expect: Expect, case: Case, status: int, raw: bytes) -> str | None:
    if expect.ending == "envelope":
        if status != 502:
            return f"status {status}, expected a 502 Anthropic error: {raw[:200]!r}"
        body = orjson.loads(raw)
        if body.get("type") != "error" or body["error"]["type"] != "api_error":
            return f"not the Anthropic error body: {body}"
        return None
    if status != 200:
        return f"status {status}: {raw[:300]!r}"
    if not case.stream:
        message = orjson.loads(raw)
        return None if message["content"][0]["text"] == case.text else f"answer {message}"
    try:
        events = events_from_sse(raw)
        ending = assert_valid_anthropic_stream(events)
    except AssertionError as exc:
        return f"invalid Anthropic stream: {exc}; tail {raw[-300:]!r}"
    if ending != expect.ending:
        return f"stream ended with {ending}, expected {expect.ending}: {raw[-300:]!r}"
    if ending == "success":
        text = "".join(b.get("text", "") for b in assemble(events)["content"])
        if text != case.text:
            return f"answer text differs: {len(text)} chars vs {len(case.text or '')}"
    return None


async def run_case(http: aiohttp.ClientSession, hal0d: TestServer, db: Path, name: str,
                   surface: str) -> list[str]:
    """Every problem with one (case, surface); an empty list when it ended as it must."""
    case = CASES[name]
    expect = case.passthrough if surface == PASSTHROUGH else case.anthropic
    request_id = f"hostile-{MODELS[name]}-{'openai' if surface == PASSTHROUGH else 'anthropic'}"
    problems = []
    async with http.post(hal0d.make_url(surface),
                         json=request_body(surface, MODELS[name], case.stream),
                         headers={"X-Request-Id": request_id}) as resp:
        status, raw = resp.status, await resp.read()
    if b"Traceback" in raw:
        problems.append("a traceback in the body")
    check = passthrough_problem if surface == PASSTHROUGH else anthropic_problem
    if problem := check(expect, case, status, raw):
        problems.append(problem)
    row = await wait_row(db, request_id)
    expected_row = (int(expect.error_code is None), expect.error_code)
    if row is None:
        problems.append("no history row")
    elif (row["ok"], row["error_code"]) != expected_row:
        problems.append(f"history row ok={row['ok']} error_code={row['error_code']!r}, "
                        f"expected ok={expected_row[0]} error_code={expected_row[1]!r}")
    if busy := await slots_idle(http, hal0d):
        problems.append(f"slot not released: {busy}")
    async with http.post(hal0d.make_url(surface), json=request_body(surface, "healthy", True)
                         ) as resp:
        after = await resp.read()
    healthy = resp.status == 200 and (
        after.endswith(DONE) if surface == PASSTHROUGH
        else assert_valid_anthropic_stream(events_from_sse(after)) == "success"
    )
    if not healthy:
        problems.append(f"the next request failed: {resp.status} {after[-200:]!r}")
    return [f"{name} on {surface}: {problem}" for problem in problems]


def entries() -> list[tuple[str, str]]:
    return [(name, surface) for name in CASES for surface in (PASSTHROUGH, ANTHROPIC)]


async def test_every_hostile_upstream_ends_cleanly_with_an_exact_history_row_on_both_surfaces(
    upstream_app, start_hal0d, http, tmp_path
):
    hal0d = await hostile_hal0d(upstream_app, start_hal0d)
    failures: list[str] = []
    tried = entries()
    for name, surface in tried:
        failures += await run_case(http, hal0d, tmp_path / "history.sqlite3", name, surface)
    print(f"hostile upstreams: {len(tried)} cases tried ({len(CASES)} upstream behaviours x "
          f"2 surfaces), failures: {len(failures)}")
    assert not failures, "\n".join(failures)


async def test_a_reset_upstream_is_not_mistaken_for_the_end_by_an_openai_sdk_client(
    upstream_app, start_hal0d, tmp_path
):
    """The error event after a reset makes the OpenAI SDK raise instead of returning a
    truncated answer as if it were whole."""
    import openai

    hal0d = await hostile_hal0d(upstream_app, start_hal0d)
    client = openai.AsyncOpenAI(base_url=str(hal0d.make_url("/v1")), api_key="x",
                                max_retries=0)
    name = "connection reset between events"
    received = []
    with pytest.raises(openai.APIError):
        stream = await client.chat.completions.create(
            model=MODELS[name], messages=[{"role": "user", "content": "hi"}], stream=True
        )
        async for piece in stream:
            received.append(piece)
    await client.close()
    assert any(c.choices and c.choices[0].delta.content == "Hello" for c in received)
