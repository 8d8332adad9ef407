"""Routes with failover over real sockets: one model served by several slots ([[routes]]), a
request handed on to the next slot only while nothing has reached the client (a dead port, a
500 or a 429, a socket that accepts and never answers, a full slot with spill_when_busy, a slot
that would have to load with prefer_loaded), never once a stream's first byte is out; the
history row, the log line and /metrics saying where it went; and check-config's refusals."""

from __future__ import annotations

import asyncio
import time
import tomllib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from structlog.testing import capture_logs

from hal0d.appkeys import DISPATCH
from hal0d.config import ConfigError, parse
from hal0d.forward.cooldown import COOLDOWN_FIRST_S
from tests.harness.client import chat_body, views
from tests.harness.config import route_config
from tests.harness.daemons import STARTUP_S, ServerFactory, launch, reload, stop
from tests.harness.poll import eventually
from tests.harness.ports import free_port
from tests.harness.processes import stub_pids
from tests.harness.stubs import Stub, StubFactory, Upstream, answering_stream, stub_command

CHAT = "/v1/chat/completions"


async def start_routed(start_hal0d: ServerFactory, text: str, tmp_path: Path) -> TestServer:
    return await start_hal0d("http://unused", config=parse(tomllib.loads(text),
                                                            base_dir=tmp_path))


async def chat(http: aiohttp.ClientSession, hal0d: TestServer, *, stream: bool = False,
               model: str = "qwen") -> tuple[int, bytes, float]:
    started = time.monotonic()
    async with http.post(hal0d.make_url(CHAT), json=chat_body(model, stream=stream)) as resp:
        body = await resp.read()
        return resp.status, body, time.monotonic() - started


async def last_row(http: aiohttp.ClientSession, hal0d: TestServer) -> dict[str, Any]:
    async with http.get(hal0d.make_url("/api/requests?limit=1")) as resp:
        [row] = (await resp.json())["requests"]
        return row


def answering(status: int) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handler(_: web.Request) -> web.Response:
        return web.json_response({"error": {"message": f"busy ({status})"}}, status=status,
                                 headers={"Retry-After": "5"} if status == 429 else None)
    return handler


async def test_a_first_slot_that_died_hands_one_request_on_and_is_skipped_after(
    start_hal0d: ServerFactory, stub: Stub, tmp_path: Path, http: aiohttp.ClientSession,
    aiohttp_server: Callable[..., Awaitable[TestServer]]
) -> None:
    """The first slot answered its probe, then died: the next request is handed on at once
    (connect refused), and the ones after it go to the second slot first while the first cools
    down. One warning says it started failing; each hand-on is an info line."""
    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": []})

    first = web.Application()
    first.router.add_get("/v1/models", models)
    one = await aiohttp_server(first)
    text = route_config(str(one.make_url("")).rstrip("/"), stub.url, tmp_path)
    hal0d = await start_routed(start_hal0d, text, tmp_path)
    await one.close()  # the box dies after hal0d found it answering
    with capture_logs() as logs:
        for stream in (False, True, False):
            status, body, took = await chat(http, hal0d, stream=stream)
            assert status == 200, body
            assert took < 0.5, took
            if stream:
                assert body.rstrip().endswith(b"data: [DONE]"), body[-200:]
    rows = await rows_of(http, hal0d, 3)
    assert [(r["slot"], r["attempts"], r["failover"]) for r in rows] == [
        ("two", 2, "one=connect_refused"), ("two", 1, None), ("two", 1, None)]
    assert rows[0]["model"] == "qwen" and rows[0]["ok"] is True
    handed = [event for event in logs if event["event"] == "dispatch.failover"]
    assert [(e["route"], e["from"], e["to"], e["reason"], e["log_level"]) for e in handed] == [
        ("qwen", "one", "two", "connect_refused", "info")]
    failing = [e for e in logs if e["event"] == "route.slot_failing"]
    assert [(e["slot"], e["log_level"]) for e in failing] == [("one", "warning")]
    async with http.get(hal0d.make_url("/metrics")) as resp:
        text = await resp.text()
    assert ('hal0d_failovers_total{reason="connect_refused",route="qwen",slot="one"} 1.0'
            in text), [line for line in text.splitlines() if "failover" in line]


async def test_a_first_slot_its_probe_found_dead_is_tried_last(
    start_hal0d: ServerFactory, stub: Stub, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    hal0d = await start_routed(start_hal0d, route_config(dead, stub.url, tmp_path), tmp_path)
    status, body, took = await chat(http, hal0d, stream=False)
    assert status == 200 and took < 0.5, (body, took)
    row = await last_row(http, hal0d)
    assert (row["slot"], row["attempts"], row["failover"]) == ("two", 1, None)


async def rows_of(http: aiohttp.ClientSession, hal0d: TestServer, n: int
                  ) -> list[dict[str, Any]]:
    """The last `n` history rows, oldest first."""
    async with http.get(hal0d.make_url(f"/api/requests?limit={n}")) as resp:
        return list(reversed((await resp.json())["requests"]))


@pytest.mark.parametrize("status", [500, 429])
async def test_a_5xx_or_429_from_the_first_slot_is_answered_by_the_second_on_both_surfaces(
    status: int, start_hal0d: ServerFactory, stub: Stub, *, upstream_app: Upstream,
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    refusing = await upstream_app({"POST /v1/chat/completions": answering(status)})
    hal0d = await start_routed(start_hal0d, route_config(refusing, stub.url, tmp_path),
                               tmp_path)
    status_seen, body, _ = await chat(http, hal0d)
    assert status_seen == 200, body
    assert orjson.loads(body)["choices"][0]["message"]["content"]
    assert (await last_row(http, hal0d))["failover"] == f"one=status_{status}"

    client = anthropic.AsyncAnthropic(base_url=str(hal0d.make_url("/llm")), api_key="unused",
                                      max_retries=0)
    async with client.messages.stream(model="qwen", max_tokens=16,
                                      messages=[{"role": "user", "content": "hi"}]) as stream:
        message = await stream.get_final_message()
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.content and message.content[0].type == "text" and message.content[0].text
    row = await last_row(http, hal0d)
    assert (row["endpoint"], row["slot"], row["attempts"]) == ("/llm/v1/messages", "two", 2)


async def test_a_first_slot_that_never_answers_is_left_after_first_byte_timeout_s(
    start_hal0d: ServerFactory, stub: Stub, *, upstream_app: Upstream, tmp_path: Path,
    http: aiohttp.ClientSession
) -> None:
    """A box that answers its probe but never a request: the first request waits the route's
    bound and is handed on, the next ones go to the second slot at once while the first cools
    down; once the cooldown is over and the box answers again, it is back, said once.

    The cooldown is hal0d's own (COOLDOWN_FIRST_S, no configuration key): the test waits for
    its end as the route sees it, not a sleep of a guessed length."""
    hangs = asyncio.Event()
    hangs.set()

    async def chat_or_hang(request: web.Request) -> web.StreamResponse:
        while hangs.is_set():
            await asyncio.sleep(0.05)
        return await answering_stream(request)

    quiet = await upstream_app({"POST /v1/chat/completions": chat_or_hang})
    text = route_config(quiet, stub.url, tmp_path, route="first_byte_timeout_s = 1.0")
    hal0d = await start_routed(start_hal0d, text, tmp_path)
    with capture_logs() as logs:
        took = []
        for _ in range(3):
            status, body, seconds = await chat(http, hal0d, stream=True)
            assert status == 200, body
            took.append(seconds)
        rows = await rows_of(http, hal0d, 3)
        assert [(r["slot"], r["failover"]) for r in rows] == [
            ("two", "one=first_byte_timeout"), ("two", None), ("two", None)]
        # The bound, then the second slot's own answer (the stub's few tokens, well under 1 s);
        # after it, no wait at all.
        assert 1.0 <= took[0] < 1.0 + 1.0 and max(took[1:]) < 0.5, took
        hangs.clear()
        cooldowns = hal0d.app[DISPATCH].placement.cooldowns
        await eventually(lambda: not cooldowns.cooling("one"), COOLDOWN_FIRST_S + 5.0,
                         "one's cooldown over")  # then tried first again, and answers
        status, body, _ = await chat(http, hal0d, stream=True)
        assert status == 200 and (await last_row(http, hal0d))["slot"] == "one"
    warned = [(e["event"], e["slot"]) for e in logs if e["log_level"] == "warning"
              and e["event"].startswith("route.")]
    assert warned == [("route.slot_failing", "one"), ("route.slot_recovered", "one")]


async def test_a_whole_answer_slower_than_first_byte_timeout_s_is_the_first_slots_alone(
    start_hal0d: ServerFactory, stub: Stub, upstream_app: Upstream, tmp_path: Path,
    http: aiohttp.ClientSession
) -> None:
    """A whole answer's headers come when its generation ends: one that takes longer than the
    route's first_byte_timeout_s is waited for (its read timeout bounds it), not generated again
    on the next slot while the first one generates on."""
    asked: list[str] = []

    async def slow_whole(request: web.Request) -> web.Response:
        asked.append("one")
        await asyncio.sleep(1.0)
        return web.json_response({"id": "c", "object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "slow but whole"},
             "finish_reason": "stop"}]})

    slow = await upstream_app({"POST /v1/chat/completions": slow_whole})
    text = route_config(slow, stub.url, tmp_path, route="first_byte_timeout_s = 0.3")
    hal0d = await start_routed(start_hal0d, text, tmp_path)
    status, body, _ = await chat(http, hal0d, stream=False)
    assert status == 200, body
    assert orjson.loads(body)["choices"][0]["message"]["content"] == "slow but whole"
    row = await last_row(http, hal0d)
    assert (row["slot"], row["failover"], row["attempts"]) == ("one", None, 1), row
    assert asked == ["one"] and stub.lines() == []  # generated once, by the first slot alone


async def test_a_stream_whose_headers_came_but_no_first_byte_is_left_after_the_bound_too(
    start_hal0d: ServerFactory, stub: Stub, upstream_app: Upstream, tmp_path: Path,
    http: aiohttp.ClientSession
) -> None:
    async def headers_then_nothing(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await asyncio.sleep(30)
        return response

    quiet = await upstream_app({"POST /v1/chat/completions": headers_then_nothing})
    text = route_config(quiet, stub.url, tmp_path, route="first_byte_timeout_s = 1.0")
    hal0d = await start_routed(start_hal0d, text, tmp_path)
    status, body, took = await chat(http, hal0d, stream=True)
    assert status == 200 and body.rstrip().endswith(b"data: [DONE]"), body[-200:]
    assert 1.0 <= took < 2.0, took
    assert (await last_row(http, hal0d))["failover"] == "one=first_byte_timeout"


async def test_once_a_stream_has_sent_its_first_byte_there_is_no_failover(
    start_hal0d: ServerFactory, start_stub: StubFactory, tmp_path: Path,
    http: aiohttp.ClientSession
) -> None:
    first, second = await start_stub(), await start_stub()
    text = route_config(first.url, second.url, tmp_path, route="first_byte_timeout_s = 5.0",
                        first_slot="stream_idle_timeout_s = 1.0")
    text = text.replace('served = { one = "chat", two = "chat" }',
                        'served = { one = "stall", two = "chat" }')
    hal0d = await start_routed(start_hal0d, text, tmp_path)
    status, body, took = await chat(http, hal0d, stream=True)
    assert status == 200
    frames = [line for line in body.split(b"\n") if line.startswith(b"data: {")]
    last = orjson.loads(frames[-1][len(b"data: "):])
    assert last["x_hal0_stall"]["reason"] == "idle", last
    assert 1.0 <= took < 3.0, took
    row = await last_row(http, hal0d)
    assert (row["slot"], row["attempts"], row["failover"]) == ("one", 1, None)
    assert row["error_code"] == "stream_stall_idle"
    assert first.lines() and second.lines() == []  # the second slot never saw it


async def test_spill_when_busy_hands_a_request_on_at_once_while_the_first_slot_is_full(
    start_hal0d: ServerFactory, start_stub: StubFactory, tmp_path: Path,
    http: aiohttp.ClientSession
) -> None:
    first, second = await start_stub(delay=0.05), await start_stub()
    text = route_config(first.url, second.url, tmp_path, route="spill_when_busy = true",
                        first_slot="max_concurrent = 1\nmax_queue = 0")
    hal0d = await start_routed(start_hal0d, text, tmp_path)
    long_stream = asyncio.create_task(http.post(
        hal0d.make_url(CHAT), json=chat_body("qwen", max_tokens=40)))
    async with await long_stream as busy:
        assert busy.status == 200
        await busy.content.readany()  # the first slot is serving it now
        status, body, took = await chat(http, hal0d)
        assert status == 200, body
        assert took < 0.5, took
        row = await last_row(http, hal0d)
        assert (row["slot"], row["failover"]) == ("two", "one=busy")
        await busy.read()
    assert len(second.lines()) >= 1


async def test_prefer_loaded_takes_the_warm_slot_and_never_starts_the_stopped_one(
    start_hal0d: ServerFactory, stub: Stub, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    port = free_port()
    command = stub_command(port, tmp_path / "cold.log")
    cold_slot = (f'command = {orjson.dumps(list(command)).decode()}\nstart = "on_demand"')
    text = route_config(f"http://127.0.0.1:{port}", stub.url, tmp_path,
                        route="prefer_loaded = true", first_slot=cold_slot)
    hal0d = await start_routed(start_hal0d, text, tmp_path)
    async with http.get(hal0d.make_url("/v1/models")) as resp:
        listed = {model["id"]: model for model in (await resp.json())["data"]}
    assert (listed["qwen"]["owned_by"], listed["qwen"]["slots"]) == ("two", ["one", "two"])
    for _ in range(3):
        status, body, _ = await chat(http, hal0d)
        assert status == 200, body
        row = await last_row(http, hal0d)
        assert (row["slot"], row["attempts"], row["failover"]) == ("two", 1, None)
    assert (await views(http, hal0d))["one"]["state"] == "stopped"
    assert stub_pids(str(tmp_path)) == set()


async def test_without_prefer_loaded_the_stopped_first_slot_is_loaded_and_answers(
    start_hal0d: ServerFactory, stub: Stub, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """The control for the test above: the same route in configured order loads `one`."""
    port = free_port()
    command = stub_command(port, tmp_path / "cold.log")
    cold_slot = (f'command = {orjson.dumps(list(command)).decode()}\nstart = "on_demand"\n'
                 f"load_timeout_s = {STARTUP_S}")
    text = route_config(f"http://127.0.0.1:{port}", stub.url, tmp_path, first_slot=cold_slot)
    hal0d = await start_routed(start_hal0d, text, tmp_path)
    status, body, _ = await chat(http, hal0d)
    assert status == 200, body
    row = await last_row(http, hal0d)
    assert (row["slot"], row["attempts"]) == ("one", 1)
    assert row["load_ms"] > 0


async def test_when_every_slot_fails_the_client_gets_the_last_error_naming_each_slot_tried(
    start_hal0d: ServerFactory, upstream_app: Upstream, tmp_path: Path,
    http: aiohttp.ClientSession
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    also_dead = f"http://127.0.0.1:{free_port()}"
    hal0d = await start_routed(start_hal0d, route_config(dead, also_dead, tmp_path), tmp_path)
    status, body, _ = await chat(http, hal0d)
    assert status == 502, body
    error = orjson.loads(body)["error"]
    assert error["code"] == "dispatch.upstream_unavailable"
    assert "slot 'two'" in error["message"] and "tried before: one=connect_refused" in (
        error["message"]), error
    row = await last_row(http, hal0d)
    assert (row["slot"], row["attempts"], row["failover"], row["ok"]) == (
        "two", 2, "one=connect_refused", False)


def refusals(text: str, tmp_path: Path) -> list[str]:
    with pytest.raises(ConfigError) as refused:
        parse(tomllib.loads(text), base_dir=tmp_path)
    return refused.value.problems


def test_check_config_refuses_unknown_slots_an_empty_route_a_slots_own_model_and_a_stray_served(
    tmp_path: Path,
) -> None:
    slots = """
[[slots]]
name = "one"
upstream = "http://127.0.0.1:1"
models = ["mine"]
"""
    assert refusals(slots + """
[[routes]]
model = "qwen"
slots = ["one", "nowhere"]

[[routes]]
model = "empty"
slots = []

[[routes]]
model = "mine"
slots = ["one"]

[[routes]]
model = "stray"
slots = ["one"]
served = { other = "x" }
""", tmp_path) == [
        "routes[0].slots: 'nowhere' is no slot (slots: one) (route \"qwen\")",
        "routes[1].slots: must be a non-empty list of non-empty strings (route \"empty\")",
        "routes[2].model: 'mine' is already slot 'one''s own model; a route names a model no "
        'slot lists (route "mine")',
        'routes[3].served.other: is not one of the route\'s slots (route "stray")',
    ]


async def test_a_second_hal0d_as_a_slot_reports_what_it_has_loaded_and_prefer_loaded_uses_it(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    box2_port, local_port = free_port(), free_port()
    box2_text = f"""
[[slots]]
name = "gpu"
upstream = "http://127.0.0.1:{box2_port}"
models = ["chat"]
command = {orjson.dumps(list(stub_command(box2_port, tmp_path / "box2.log"))).decode()}
start = "on_demand"

[metrics]
database = "{tmp_path / 'box2.sqlite3'}"
"""
    box2 = await start_routed(start_hal0d, box2_text, tmp_path)
    local_command = list(stub_command(local_port, tmp_path / "local.log"))
    local_slot = f'command = {orjson.dumps(local_command).decode()}\nstart = "on_demand"'
    text = route_config(f"http://127.0.0.1:{local_port}",
                        str(box2.make_url("")).rstrip("/"), tmp_path,
                        route="prefer_loaded = true", first_slot=local_slot,
                        second_slot='kind = "hal0d"')
    box1 = await start_routed(start_hal0d, text, tmp_path)

    async def qwen_listed() -> dict[str, Any]:
        async with http.get(box1.make_url("/v1/models")) as resp:
            return next(m for m in (await resp.json())["data"] if m["id"] == "qwen")

    # Nothing is loaded anywhere: the configured order, `one` (the local slot) first.
    listed = await qwen_listed()
    assert (listed["owned_by"], listed["state"]) == ("one", "stopped"), listed
    # The model is loaded on box2 through box2's own API: box1 hears of it from box2's feed.
    async with http.post(box2.make_url("/api/slots/gpu/load")) as resp:
        assert resp.status == 200, await resp.text()

    async def box2_first() -> bool:
        listed = await qwen_listed()
        return (listed["owned_by"], listed["state"]) == ("two", "ready")

    await eventually(box2_first, 5, "box2's loaded model in box1's /v1/models")
    status, body, _ = await chat(http, box1)
    assert status == 200, body
    row = await last_row(http, box1)
    assert (row["slot"], row["attempts"]) == ("two", 1)
    assert (await views(http, box1))["one"]["state"] == "stopped"
    assert "start rid=" in (tmp_path / "box2.log").read_text()  # box2's process answered
    assert not (tmp_path / "local.log").exists()  # the local one was never started


async def test_a_responses_answer_is_handed_on_and_its_stored_copy_read_from_the_slot_that_made_it(
    start_hal0d: ServerFactory, stub: Stub, upstream_app: Upstream, tmp_path: Path,
    http: aiohttp.ClientSession
) -> None:
    import openai

    refusing = await upstream_app({"POST /v1/responses": answering(503)})
    hal0d = await start_routed(start_hal0d, route_config(refusing, stub.url, tmp_path),
                               tmp_path)
    client = openai.AsyncOpenAI(base_url=str(hal0d.make_url("/v1")), api_key="unused",
                                max_retries=0)
    made = await client.responses.create(model="qwen", input="hi")
    assert made.status == "completed" and made.output_text
    row = await last_row(http, hal0d)
    assert (row["endpoint"], row["slot"], row["failover"]) == (
        "/v1/responses", "two", "one=status_503")
    # GET goes to the slot that holds the answer, not to the route's first (refusing) slot.
    again = await client.responses.retrieve(made.id)
    assert again.id == made.id
    row = await last_row(http, hal0d)
    assert (row["endpoint"], row["slot"], row["attempts"]) == ("/v1/responses/{id}", "two", 1)


async def test_an_ollama_client_is_handed_on_too_and_lists_the_routes_model(
    start_ollama: Callable[..., Awaitable[tuple[TestServer, str]]], stub: Stub,
    upstream_app: Upstream, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    import ollama

    refusing = await upstream_app({"POST /v1/chat/completions": answering(503)})
    config = parse(tomllib.loads(route_config(refusing, stub.url, tmp_path)), base_dir=tmp_path)
    hal0d, base = await start_ollama("http://unused", config=config)
    client = ollama.AsyncClient(host=base)
    assert "qwen" in [model.model for model in (await client.list()).models]
    answer = await client.chat(model="qwen", messages=[{"role": "user", "content": "hi"}],
                               stream=False)
    assert answer.message.content and answer.done_reason in ("stop", "length")
    row = await last_row(http, hal0d)
    assert (row["endpoint"], row["slot"], row["failover"]) == (
        "/api/chat", "two", "one=status_503")


async def test_a_reload_that_moves_a_slots_upstream_asks_the_new_one_at_once(
    tmp_path: Path, http: aiohttp.ClientSession, upstream_app: Upstream
) -> None:
    """The slot's state and reason were its old upstream's (refusing): after the reload they
    are the new one's (answering) within a moment, not at the next probe round (10 s)."""
    old, new = f"http://127.0.0.1:{free_port()}", await upstream_app({})

    def slot(upstream: str) -> str:
        return (f'[[slots]]\nname = "deadbox"\nupstream = "{upstream}"\n'
                'models = ["assist"]\n')

    hal0d = await launch(tmp_path, "unused", slot=slot(old))
    try:
        async def view() -> dict[str, Any]:
            async with http.get(f"{hal0d.url}/api/slots") as resp:
                [shown] = (await resp.json())["slots"]
            return dict(shown)

        refused = await view()
        assert (refused["state"], refused["reason"]) == (
            "error", "cannot connect (connection refused)"), refused
        await reload(hal0d, slot(new))

        async def moved() -> dict[str, Any]:
            seen = await view()
            assert (seen["upstream"], seen["state"], seen["reason"]) == (new, "ready", None), seen
            return seen

        await eventually(moved, 3.0, "the state and reason of the new upstream")
    finally:
        await stop(hal0d.process)
