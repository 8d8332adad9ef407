"""Per-slot stall and read bounds: a slot's own `stream_total_timeout_s`, `stream_idle_timeout_s`
and `direct_read_timeout_s` replace the [dispatcher] values for its requests, an absent one falls
back to them. Validated with key paths, shown by print-config only where set, and a reload drains
for the largest bound over the slots. The stream tests run over real sockets: two slots on one
purpose-built upstream, one slot with its own bound, one without."""

from __future__ import annotations

import asyncio
import time
import tomllib
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import hdrs, web

from hal0d import config
from hal0d.protocol.sse import Decoder
from hal0d.server import DRAIN_UNBOUNDED_S, drain_time
from tests.harness.cli import hal0d_cli
from tests.harness.client import chat_body
from tests.harness.config import SLOT, make_config, write
from tests.harness.stubs import ROLE_CHUNK, content_chunk

# How late after its bound a trip may be seen by the client on a busy two-core machine.
SLACK = 0.5


@pytest.mark.parametrize(
    ("toml", "problem"),
    [
        (SLOT + "stream_idle_timeout_s = -1\n",
         "slots[0].stream_idle_timeout_s: -1.0 is outside 0.0-86400.0"),
        (SLOT + "stream_total_timeout_s = 90000\n",
         "slots[0].stream_total_timeout_s: 90000.0 is outside 0.0-86400.0"),
        (SLOT + "direct_read_timeout_s = 5\n",
         "slots[0].direct_read_timeout_s: 5.0 is outside 30.0-600.0"),
        (SLOT + 'stream_idle_timeout_s = "3 sec"\n',
         "slots[0].stream_idle_timeout_s: '3 sec' is not a duration"),
    ],
)
def test_bad_slot_bounds_are_reported_with_their_key_path(tmp_path, toml, problem):
    with pytest.raises(config.ConfigError) as caught:
        config.load(write(tmp_path, toml))
    assert any(problem in p for p in caught.value.problems), caught.value.problems


def two_slots(tmp_path: Any) -> config.Config:
    own = SLOT + "stream_idle_timeout_s = 3\nstream_total_timeout_s = 0\n"
    own += "direct_read_timeout_s = 45\n"
    other = SLOT.replace('"a"', '"b"').replace('["m"]', '["n"]')
    return config.load(write(tmp_path, "[dispatcher]\nstream_idle_timeout_s = 200\n" + own + other))


def test_a_slots_own_bounds_override_and_absent_ones_fall_back_to_the_dispatcher(tmp_path):
    loaded = two_slots(tmp_path)
    own, other = (slot.timeouts(loaded.dispatcher) for slot in loaded.slots)
    assert (own.stream_idle_timeout_s, own.stream_total_timeout_s, own.direct_read_timeout_s) == (
        3.0, 0.0, 45.0  # 0 is kept: the slot turns the total bound off for itself
    )
    assert own.connect_timeout_s == loaded.dispatcher.connect_timeout_s
    assert other == loaded.dispatcher
    assert (other.stream_idle_timeout_s, other.stream_total_timeout_s) == (200.0, 900.0)


def test_print_config_shows_slot_bounds_only_where_set_and_round_trips(tmp_path):
    path = two_slots(tmp_path).base_dir / "hal0d.toml"
    result = hal0d_cli("print-config", "--config", str(path))
    assert result.returncode == 0, result.stderr
    own, other = tomllib.loads(result.stdout)["slots"]
    assert own["stream_idle_timeout_s"] == 3.0 and own["stream_total_timeout_s"] == 0.0
    assert own["direct_read_timeout_s"] == 45.0
    assert not set(config.SLOT_TIMEOUT_KEYS) & set(other), other
    assert config.load(write(tmp_path, result.stdout)) == config.load(path)


def test_a_reload_drains_for_the_largest_effective_bound_over_the_slots(tmp_path):
    base = "[dispatcher]\nstream_total_timeout_s = 900\ndirect_read_timeout_s = 300\n"
    b = SLOT.replace('"a"', '"b"').replace('["m"]', '["n"]')
    assert drain_time(config.load(write(tmp_path, base + SLOT + b))) == 900.0
    longer = base + SLOT + "stream_total_timeout_s = 2000\n" + b
    assert drain_time(config.load(write(tmp_path, longer))) == 2000.0
    # Both slots short: the dispatcher's 900 s, which no slot runs on, does not count.
    short = (base + SLOT + "stream_total_timeout_s = 15\ndirect_read_timeout_s = 30\n"
             + b + "stream_total_timeout_s = 20\ndirect_read_timeout_s = 30\n")
    assert drain_time(config.load(write(tmp_path, short))) == 30.0
    off = base + SLOT + "stream_total_timeout_s = 0\n" + b
    assert drain_time(config.load(write(tmp_path, off))) == DRAIN_UNBOUNDED_S


async def silent_after_one_token(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={hdrs.CONTENT_TYPE: "text/event-stream"})
    await response.prepare(request)
    await response.write(ROLE_CHUNK + content_chunk("Hi"))
    await asyncio.Event().wait()  # silence, the connection left open
    return response


async def chatty_forever(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={hdrs.CONTENT_TYPE: "text/event-stream"})
    await response.prepare(request)
    await response.write(ROLE_CHUNK)
    while True:
        await asyncio.sleep(0.05)
        await response.write(content_chunk(" more"))


def stall_details(raw: bytes) -> dict[str, Any] | None:
    """The x_hal0_stall details of the stream's stall-guard frame, None without one."""
    decoder = Decoder()
    for event in decoder.feed(raw) + decoder.close():
        if "x_hal0_stall" in event.data:
            details: dict[str, Any] = orjson.loads(event.data)["x_hal0_stall"]
            return details
    return None


async def stream_for(
    http: aiohttp.ClientSession, url: Any, model: str, at_most_s: float
) -> tuple[bytes, float]:
    """The body of a streamed chat completion and how long it took; the client leaves after
    `at_most_s` if the stream has not ended by then."""
    started = time.monotonic()
    raw = b""
    async with http.post(url, json=chat_body(model)) as resp:
        assert resp.status == 200
        try:
            async with asyncio.timeout(at_most_s):
                async for data in resp.content.iter_any():
                    raw += data
        except TimeoutError:
            pass
    return raw, time.monotonic() - started


async def test_a_slots_own_idle_bound_trips_its_stream_and_the_other_slot_keeps_the_dispatchers(
    upstream_app, start_hal0d, http, tmp_path
):
    url = await upstream_app({"POST /v1/chat/completions": silent_after_one_token})
    hal0d = await start_hal0d(url, config=make_config(
        url, tmp_path=tmp_path, models=("own",), slot={"stream_idle_timeout_s": 0.3},
        dispatcher={"stream_idle_timeout_s": 1.2, "stream_total_timeout_s": 0},
        extra_slots=(config.SlotConfig(name="inherits", upstream=url, models=("inherited",)),),
    ))
    chat = hal0d.make_url("/v1/chat/completions")
    raw, took = await stream_for(http, chat, "own", at_most_s=5)
    own = stall_details(raw)
    assert own is not None, raw
    assert (own["reason"], own["upstream"], own["stream_idle_timeout_s"]) == ("idle", "llm", 0.3)
    assert 0.3 <= own["elapsed_s"] < 0.3 + SLACK and took < 1.2  # not the dispatcher's 1.2 s

    raw, took = await stream_for(http, chat, "inherited", at_most_s=5)
    inherited = stall_details(raw)
    assert inherited is not None, raw
    assert (inherited["reason"], inherited["upstream"]) == ("idle", "inherits")
    assert inherited["stream_idle_timeout_s"] == 1.2
    assert 1.2 <= inherited["elapsed_s"] < 1.2 + SLACK


async def test_a_slots_own_total_bound_of_0_turns_it_off_while_the_other_slot_is_cut(
    upstream_app, start_hal0d, http, tmp_path
):
    url = await upstream_app({"POST /v1/chat/completions": chatty_forever})
    hal0d = await start_hal0d(url, config=make_config(
        url, tmp_path=tmp_path, models=("unbounded",), slot={"stream_total_timeout_s": 0},
        dispatcher={"stream_total_timeout_s": 0.5, "stream_idle_timeout_s": 0},
        extra_slots=(config.SlotConfig(name="inherits", upstream=url, models=("bounded",)),),
    ))
    chat = hal0d.make_url("/v1/chat/completions")
    raw, _ = await stream_for(http, chat, "bounded", at_most_s=5)
    bounded = stall_details(raw)
    assert bounded is not None, raw
    assert (bounded["reason"], bounded["upstream"]) == ("total", "inherits")
    assert 0.5 <= bounded["elapsed_s"] < 0.5 + SLACK

    # Three times the dispatcher's bound later, the slot that turned it off still streams.
    raw, took = await stream_for(http, chat, "unbounded", at_most_s=1.5)
    assert took >= 1.5 and stall_details(raw) is None
    assert raw.count(b'" more"') >= 10, raw[-300:]


async def test_a_slots_own_direct_read_bound_ends_a_non_streamed_stall_with_a_clean_502(
    stub, start_hal0d, http
):
    """The stub's `stall` never answers a non-streamed request: the slot's 0.5 s bound (not the
    dispatcher's 300 s) turns it into a 502 in each surface's envelope, and the slot is free."""
    hal0d = await start_hal0d(stub.url, slot={"direct_read_timeout_s": 0.5})
    anthropic = {"model": "stall", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    for path, body in (("/v1/chat/completions", chat_body("stall", stream=False)),
                       ("/llm/v1/messages", anthropic)):
        started = time.monotonic()
        async with asyncio.timeout(10), http.post(hal0d.make_url(path), json=body) as resp:
            answer = await resp.json()
        assert resp.status == 502, answer
        assert resp.content_type == "application/json"
        if path.startswith("/llm"):
            assert answer["type"] == "error" and answer["error"]["type"] == "api_error", answer
        else:
            assert answer["error"]["code"] == "dispatch.upstream_unavailable", answer
        assert 0.5 <= time.monotonic() - started < 0.5 + 2 * SLACK
    assert sum("stalling model=stall" in line for line in stub.lines()) == 2, stub.lines()
    async with http.get(hal0d.make_url("/api/slots")) as resp:
        assert (await resp.json())["slots"][0]["in_flight"] == 0
