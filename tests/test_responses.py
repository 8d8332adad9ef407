"""The OpenAI Responses API through hal0d, driven by the official openai SDK over real sockets.

hal0d sits in front of the stub upstream (its /v1/responses); what the SDK ends up with is
compared to what the stub generated (hal0d_stub.models.CONTENT_TEXT), and the stall and break
cases to what a Responses client must see: an incomplete answer carrying the guard's notice, or
an error. The SDK is imported where it is used: importing it costs about a second at collection.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
import pytest
from aiohttp import hdrs, web
from aiohttp.test_utils import TestServer

from hal0d.response_owners import ResponseOwners
from hal0d_stub.answering import TOKENS_BEFORE_TROUBLE
from hal0d_stub.models import CONTENT_TEXT, words
from tests.harness.client import openai_sdk
from tests.harness.poll import eventually
from tests.harness.stubs import Stub

if TYPE_CHECKING:
    from openai import AsyncOpenAI

STALL_BOUNDS = {"stream_idle_timeout_s": 0.5, "stream_total_timeout_s": 30.0}


@pytest.fixture
async def hal0d(stub: Stub, start_hal0d: Any) -> TestServer:
    return await start_hal0d(stub.url, aliases={"gpt-*": "chat"})


@pytest.fixture
async def guarded(stub: Stub, start_hal0d: Any) -> TestServer:
    """hal0d with a short idle bound, for the `stall` model only: a loaded machine must not
    trip it on a healthy stream."""
    return await start_hal0d(stub.url, dispatcher=STALL_BOUNDS)


@pytest.fixture
async def client(hal0d: TestServer) -> AsyncIterator[AsyncOpenAI]:
    async with openai_sdk(hal0d) as client:
        yield client


@pytest.fixture
async def stall_client(guarded: TestServer) -> AsyncIterator[AsyncOpenAI]:
    async with openai_sdk(guarded) as client:
        yield client


async def history(http: aiohttp.ClientSession, hal0d: TestServer, count: int) -> list[Any]:
    async def rows() -> list[Any]:
        async with http.get(hal0d.make_url(f"/api/requests?limit={count}")) as answer:
            found = (await answer.json())["requests"]
        assert len(found) >= count, found
        return list(found)

    return await eventually(rows, 5.0, f"{count} history rows")


async def test_sdk_create_streamed_gives_the_stubs_text_and_a_completed_response(
    client: AsyncOpenAI,
) -> None:
    stream = await client.responses.create(model="chat", input="hi", stream=True)
    events = [event async for event in stream]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == CONTENT_TEXT
    assert events[-1].type == "response.completed"
    assert events[-1].response.output_text == CONTENT_TEXT


async def test_sdk_stream_helper_accumulates_the_final_response(client: AsyncOpenAI) -> None:
    async with client.responses.stream(model="chat", input="hi") as stream:
        async for _ in stream:
            pass
        final = await stream.get_final_response()
    assert final.status == "completed"
    assert final.output_text == CONTENT_TEXT
    assert final.usage is not None and final.usage.output_tokens == len(words(CONTENT_TEXT))


async def test_sdk_create_whole_is_relayed_and_alias_applied(client: AsyncOpenAI) -> None:
    raw = await client.responses.with_raw_response.create(model="gpt-4.1", input="hi")
    response = raw.parse()
    assert raw.http_request.url.path == "/v1/responses"
    assert response.output_text == CONTENT_TEXT
    assert response.model == "chat"  # the stub saw the alias's target


async def test_stalled_stream_ends_incomplete_with_the_notice_and_the_sdk_does_not_raise(
    stall_client: AsyncOpenAI, stub: Stub
) -> None:
    async with stall_client.responses.stream(model="stall", input="hi") as stream:
        events = [event async for event in stream]
    last = events[-1]
    assert last.type == "response.incomplete"
    assert last.response.status == "incomplete"
    assert last.response.incomplete_details is not None
    assert last.response.incomplete_details.reason == "max_output_tokens"
    diagnostic = (last.response.model_extra or {})["x_hal0_stall"]
    assert diagnostic["reason"] == "idle"
    text = last.response.output_text
    # What the stub generated before it went silent, then the guard's notice in the same part.
    assert text.startswith("".join(words(CONTENT_TEXT)[:TOKENS_BEFORE_TROUBLE]))
    assert "[hal0] stall guard" in text
    assert any("stalling" in line for line in stub.lines())  # the upstream did go silent


async def test_broken_stream_raises_in_the_sdk(client: AsyncOpenAI) -> None:
    from openai import APIError

    stream = await client.responses.create(model="broken", input="hi", stream=True)
    seen: list[str] = []
    with pytest.raises(APIError, match="broke the stream"):
        async for event in stream:
            seen.append(event.type)
    assert "response.output_text.delta" in seen  # it broke mid-answer, not before


async def test_broken_stream_ends_with_error_then_response_failed_on_the_wire(
    hal0d: TestServer, http: aiohttp.ClientSession
) -> None:
    async with http.post(hal0d.make_url("/v1/responses"),
                         json={"model": "broken", "input": "hi", "stream": True}) as answer:
        body = await answer.read()
    names = [line.split(b": ", 1)[1] for line in body.split(b"\n")
             if line.startswith(b"event: ")]
    assert names[-2:] == [b"error", b"response.failed"]
    sequences = [orjson.loads(line[6:])["sequence_number"] for line in body.split(b"\n")
                 if line.startswith(b"data: ")]
    assert sequences == list(range(len(sequences)))  # hal0d's events continue the upstream's


async def test_healthy_stream_bytes_equal_the_upstreams(
    stub: Stub, upstream_app: Any, start_hal0d: Any, http: aiohttp.ClientSession
) -> None:
    # A real Responses stream recorded from the stub, then served by an upstream that sends
    # exactly those bytes in small reads: what reaches the client must be the same bytes.
    request = {"model": "chat", "input": "hi", "stream": True}
    async with http.post(f"{stub.url}/v1/responses", json=request) as answer:
        recorded = await answer.read()

    async def replay(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for at in range(0, len(recorded), 97):
            await response.write(recorded[at:at + 97])
        return response

    upstream = await upstream_app({"POST /v1/responses": replay})
    hal0d = await start_hal0d(upstream, models=("chat",))
    async with http.post(hal0d.make_url("/v1/responses"), json=request) as answer:
        assert answer.headers["Content-Type"].startswith("text/event-stream")
        through = await answer.read()
    assert through == recorded


async def test_get_and_delete_reach_the_slot_that_made_the_response(
    client: AsyncOpenAI, stub: Stub
) -> None:
    made = await client.responses.create(model="gpt-4o", input="hi")
    fetched = await client.responses.retrieve(made.id)
    assert fetched.id == made.id and fetched.output_text == CONTENT_TEXT
    async with client.responses.stream(model="chat", input="hi") as stream:
        streamed = await stream.get_final_response()
    assert (await client.responses.retrieve(streamed.id)).id == streamed.id  # id from the stream
    await client.responses.delete(made.id)
    assert any("endpoint=responses" in line for line in stub.lines())


async def test_head_of_a_stored_response_is_its_gets_status_and_headers_without_a_body(
    hal0d: TestServer, http: aiohttp.ClientSession
) -> None:
    """`curl -I` of a response: answered at once, as GET is but for the body, and the slot is
    free again right after (no lease held until a read timeout)."""
    async with http.post(hal0d.make_url("/v1/responses"),
                         json={"model": "chat", "input": "hi"}) as answer:
        assert answer.status == 200
        made = await answer.json()
    url = hal0d.make_url(f"/v1/responses/{made['id']}")
    async with http.get(url) as got:
        body = await got.read()
    async with asyncio.timeout(5.0):
        async with http.head(url) as head:
            assert await head.read() == b""
    assert head.status == got.status == 200
    assert body and orjson.loads(body)["id"] == made["id"]
    assert head.headers[hdrs.CONTENT_TYPE] == got.headers[hdrs.CONTENT_TYPE]
    assert head.headers[hdrs.CONTENT_LENGTH] == got.headers[hdrs.CONTENT_LENGTH] == str(len(body))

    async def slot_at_rest() -> bool:
        async with http.get(hal0d.make_url("/api/slots")) as answer:
            [slot] = (await answer.json())["slots"]
        assert slot["in_flight"] == 0, slot
        return True

    await eventually(slot_at_rest, 2.0, "the slot's in_flight back to 0 after the HEAD")


async def test_unknown_response_id_is_a_404_in_the_openai_envelope(
    hal0d: TestServer, http: aiohttp.ClientSession
) -> None:
    for method in ("GET", "DELETE"):
        async with http.request(method, hal0d.make_url("/v1/responses/resp_nobody")) as answer:
            assert answer.status == 404
            body = await answer.json()
        assert body["error"]["code"] == "dispatch.no_route"
        assert "resp_nobody" in body["error"]["message"]


async def test_a_deleted_response_is_forgotten(client: AsyncOpenAI) -> None:
    from openai import NotFoundError

    made = await client.responses.create(model="chat", input="hi")
    await client.responses.delete(made.id)
    with pytest.raises(NotFoundError):
        await client.responses.retrieve(made.id)


async def test_bad_input_is_a_400_in_the_openai_envelope(
    hal0d: TestServer, http: aiohttp.ClientSession
) -> None:
    for body, field in (({"input": "hi"}, "model"),
                        ({"model": "chat", "stream": "yes"}, "stream"),
                        ({"model": "chat", "max_output_tokens": 0}, "max_output_tokens"),
                        ({"model": "chat", "input": 3}, "input")):
        async with http.post(hal0d.make_url("/v1/responses"), json=body) as answer:
            assert answer.status == 400, body
            error = (await answer.json())["error"]
        assert error["param"] == field


async def test_history_rows_and_metrics_for_responses(
    client: AsyncOpenAI, stall_client: AsyncOpenAI, hal0d: TestServer, guarded: TestServer,
    http: aiohttp.ClientSession,
) -> None:
    async with client.responses.stream(model="chat", input="hi") as stream:
        await stream.get_final_response()
    async with stall_client.responses.stream(model="stall", input="hi") as stream:
        [event async for event in stream]
    healthy = (await history(http, hal0d, 1))[0]
    stalled = (await history(http, guarded, 1))[0]
    assert healthy["endpoint"] == "/v1/responses" and healthy["ok"]
    assert healthy["ttft_ms"] is not None and healthy["ttft_ms"] > 0
    assert healthy["completion_tokens"] == len(words(CONTENT_TEXT))
    assert healthy["prompt_tokens"] is not None
    assert stalled["error_code"] == "stream_stall_idle" and not stalled["ok"]
    async with http.get(hal0d.make_url("/api/slots/metrics")) as answer:
        live = (await answer.json())["slots"][0]
    assert live["tokens_per_s"] is not None and live["ttft_ms"]["samples"] == 1


async def test_llm_prefix_serves_responses_too(
    hal0d: TestServer, http: aiohttp.ClientSession
) -> None:
    async with http.post(hal0d.make_url("/llm/v1/responses"),
                         json={"model": "chat", "input": "hi"}) as answer:
        assert answer.status == 200
        assert (await answer.json())["status"] == "completed"


def test_owners_are_an_lru_bounded_at_its_capacity() -> None:
    owners = ResponseOwners(capacity=3)
    for name in ("a", "b", "c"):
        owners.remember(name, "chat", "llm")
    assert owners.owner("a") == ("chat", "llm")  # used: now the most recent
    owners.remember("d", "chat", "llm")
    assert len(owners) == 3
    assert owners.owner("b") is None and owners.owner("a") == ("chat", "llm")


async def test_stub_answers_get_for_a_response_it_kept(stub: Stub) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{stub.url}/v1/responses",
                             json={"model": "chat", "input": "hi"}) as answer:
            made = await answer.json()
        async with http.get(f"{stub.url}/v1/responses/{made['id']}") as answer:
            assert (await answer.json())["id"] == made["id"]
