"""A reload (SIGHUP to a real `hal0d serve`) applies the lifecycle keys of its slots: a changed
command is loaded by the next request once the old process's requests are done, a removed slot
is drained before its process stops, `start` switches both ways, and idle_unload_s and the group
limits count from the next decision. Each slot's command is the real stub."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from tests.harness.client import Stream, chat, chat_body, open_stream, state_is, views
from tests.harness.daemons import STARTUP_S, Hal0dProcess, Hal0dProcessFactory, reload
from tests.harness.observe import after_the_stream
from tests.harness.poll import eventually
from tests.harness.ports import free_port
from tests.harness.processes import ProcessSampler, alive, stub_pids

TOKEN_DELAY_S = 0.02
STREAM_TOKENS = 40  # about 0.8 s: still running when the reload lands

# One port per slot of a test, so a reloaded config changes only the keys the test changes.
_PORTS: dict[tuple[Path, str], int] = {}


def slot_toml(name: str, model: str, tmp_path: Path, *, log: str | None = None,
              **keys: Any) -> str:
    """A [[slots]] table whose command is the stub, logging to `log` (default NAME.log)."""
    port = _PORTS.setdefault((tmp_path, name), free_port())
    command = [sys.executable, "-m", "hal0d", "stub", "--port", str(port),
               "--delay", str(TOKEN_DELAY_S), "--log", str(tmp_path / (log or f"{name}.log"))]
    lines = [f'name = "{name}"', f'upstream = "http://127.0.0.1:{port}"',
             f'models = ["{model}"]', f"command = {orjson.dumps(command).decode()}"]
    lines += [f"{key} = {orjson.dumps(value).decode()}" for key, value in keys.items()]
    return "[[slots]]\n" + "\n".join(lines) + "\n"


def group_toml(name: str, **keys: Any) -> str:
    return f"[groups.{name}]\n" + "".join(f"{k} = {orjson.dumps(v).decode()}\n"
                                          for k, v in keys.items())


async def stream_running(http: aiohttp.ClientSession, hal0d: Hal0dProcess,
                         model: str) -> tuple[Stream, asyncio.Task[None]]:
    stream = Stream(f"a stream on {model}")
    task = asyncio.create_task(open_stream(http, hal0d.url, stream, chat_body(
        model, max_tokens=STREAM_TOKENS)))
    await asyncio.wait_for(stream.first_chunk.wait(), STARTUP_S)
    assert stream.raw, stream.error
    return stream, task


async def test_a_changed_command_unloads_after_its_stream_and_the_next_request_loads_it(
    start_hal0d_process: Hal0dProcessFactory, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    hal0d = await start_hal0d_process(slot=slot_toml("a", "reasoning", tmp_path, start="on_demand"))
    stream, task = await stream_running(http, hal0d, "reasoning")
    old_pid = (await views(http, hal0d))["a"]["pid"]

    reloaded = await reload(hal0d, slot_toml("a", "reasoning", tmp_path, start="on_demand",
                                             log="a-new.log"))
    assert reloaded["slots_changed"] == ["a"]
    await state_is(http, hal0d, "a", "stopping")  # new requests wait for the new command
    await task
    assert stream.finished_normally(), stream.data[-2:]
    view = await state_is(http, hal0d, "a", "stopped")
    assert "reload" in view["reason"] and not alive(old_pid)
    assert await after_the_stream(http, hal0d, "slot.unloaded", "a")

    status, answer = await chat(http, hal0d, "reasoning")
    assert status == 200, answer
    assert "start rid=" in (tmp_path / "a-new.log").read_text()  # the new command served it
    assert (await views(http, hal0d))["a"]["pid"] not in (None, old_pid)


async def test_a_second_reload_while_an_always_slot_drains_stops_its_old_process_once(
    start_hal0d_process: Hal0dProcessFactory, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """Two reloads of an `always` slot's command, the second while the old process still drains
    a stream: the slot waits in `starting` throughout, the stream ends on the old process, that
    process is stopped, the first reload's command never runs and the second one's serves."""
    hal0d = await start_hal0d_process(slot=slot_toml("a", "reasoning", tmp_path))
    await state_is(http, hal0d, "a", "ready")
    old_pid = hal0d.named("slot.process_started")[0]["pid"]
    stream = Stream("a stream on the old process")
    task = asyncio.create_task(open_stream(http, hal0d.url, stream, chat_body(
        "reasoning", max_tokens=150)))  # about 3 s: both reloads land while it runs
    await asyncio.wait_for(stream.first_chunk.wait(), STARTUP_S)

    await reload(hal0d, slot_toml("a", "reasoning", tmp_path, log="a-first.log"))
    assert (await views(http, hal0d))["a"]["state"] == "starting"
    await reload(hal0d, slot_toml("a", "reasoning", tmp_path, log="a-second.log"))
    assert (await views(http, hal0d))["a"]["state"] == "starting"
    assert not task.done(), "the stream ended before the second reload: the test proves nothing"
    await task
    assert stream.finished_normally(), stream.data[-2:]
    await state_is(http, hal0d, "a", "ready")
    assert not alive(old_pid)

    status, answer = await chat(http, hal0d, "reasoning")
    assert status == 200, answer
    assert "start rid=" in (tmp_path / "a-second.log").read_text()
    assert not (tmp_path / "a-first.log").exists()
    assert len(stub_pids(str(tmp_path))) == 1, "one process for the slot, no leftover"


async def test_a_removed_slot_drains_its_stream_then_its_process_stops(
    start_hal0d_process: Hal0dProcessFactory, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    b = slot_toml("b", "chat", tmp_path, start="on_demand")
    a = slot_toml("a", "reasoning", tmp_path, start="on_demand")
    hal0d = await start_hal0d_process(slot=a + b)
    stream, task = await stream_running(http, hal0d, "reasoning")
    pid = (await views(http, hal0d))["a"]["pid"]

    reloaded = await reload(hal0d, b)
    assert reloaded["slots_removed"] == ["a"]
    await task
    assert stream.finished_normally(), stream.data[-2:]
    await eventually(lambda: not alive(pid), STARTUP_S, "the removed slot's process gone")
    assert await after_the_stream(http, hal0d, "slot.process_stopped", "a")
    assert "a" not in await views(http, hal0d)


async def test_always_to_on_demand_rests_stopped_after_its_stream_and_loads_on_request(
    start_hal0d_process: Hal0dProcessFactory, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    hal0d = await start_hal0d_process(slot=slot_toml("a", "reasoning", tmp_path))
    await state_is(http, hal0d, "a", "ready")
    pid = hal0d.named("slot.process_started")[0]["pid"]
    stream, task = await stream_running(http, hal0d, "reasoning")

    reloaded = await reload(hal0d, slot_toml("a", "reasoning", tmp_path, start="on_demand"))
    assert reloaded["slots_changed"] == ["a"]
    await task
    assert stream.finished_normally(), stream.data[-2:]
    await state_is(http, hal0d, "a", "stopped")
    assert not alive(pid)
    assert await after_the_stream(http, hal0d, "slot.process_stopped", "a")

    status, answer = await chat(http, hal0d, "reasoning")
    assert status == 200, answer
    view = (await views(http, hal0d))["a"]
    assert view["state"] == "ready" and view["pid"] not in (None, pid)


async def test_on_demand_to_always_starts_at_once_and_is_pinned_in_its_group(
    start_hal0d_process: Hal0dProcessFactory, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """b turned `always` starts without a request; the group holds one model, so the loaded
    on-demand a is unloaded first, and a cannot load again beside the pinned b."""
    group = group_toml("gpu0", max_loaded=1)

    def slots(b_start: str) -> str:
        return (slot_toml("a", "reasoning", tmp_path, start="on_demand", group="gpu0")
                + slot_toml("b", "chat", tmp_path, start=b_start, group="gpu0") + group)

    hal0d = await start_hal0d_process(slot=slots("on_demand"))
    assert (await chat(http, hal0d, "reasoning"))[0] == 200
    with ProcessSampler(str(tmp_path)) as sampler:
        reloaded = await reload(hal0d, slots("always"))
        assert reloaded["slots_changed"] == ["b"]
        await state_is(http, hal0d, "b", "ready")
    view = (await views(http, hal0d))["a"]
    assert view["state"] == "stopped" and "evicted" in view["reason"]
    assert sampler.most_alive == 1

    status, answer = await chat(http, hal0d, "reasoning")
    assert status == 503 and answer["error"]["code"] == "slot.load_failed", answer
    assert "no room" in answer["error"]["message"]


async def test_a_shortened_idle_unload_s_applies_to_a_slot_already_idle(
    start_hal0d_process: Hal0dProcessFactory, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    hal0d = await start_hal0d_process(slot=slot_toml("a", "reasoning", tmp_path, start="on_demand",
                                  idle_unload_s=600))
    assert (await chat(http, hal0d, "reasoning"))[0] == 200
    pid = (await views(http, hal0d))["a"]["pid"]
    await reload(hal0d, slot_toml("a", "reasoning", tmp_path, start="on_demand",
                                  idle_unload_s=0.5))
    view = await state_is(http, hal0d, "a", "stopped")
    assert "idle" in view["reason"] and not alive(pid)


async def test_a_lowered_max_loaded_applies_to_the_next_load(
    start_hal0d_process: Hal0dProcessFactory, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    def slots(max_loaded: int) -> str:
        return "".join(slot_toml(name, model, tmp_path, start="on_demand", group="gpu0")
                       for name, model in (("a", "reasoning"), ("b", "chat"), ("c", "tool"))
                       ) + group_toml("gpu0", max_loaded=max_loaded)

    hal0d = await start_hal0d_process(slot=slots(2))
    for model in ("reasoning", "chat"):
        assert (await chat(http, hal0d, model))[0] == 200
    assert {v["state"] for v in (await views(http, hal0d)).values()} == {"ready", "stopped"}
    await reload(hal0d, slots(1))
    status, answer = await chat(http, hal0d, "tool")
    assert status == 200, answer
    states = {name: view["state"] for name, view in (await views(http, hal0d)).items()}
    assert states == {"a": "stopped", "b": "stopped", "c": "ready"}
    assert [e["slot"] for e in hal0d.named("slot.evicting")] == ["a", "b"]


async def test_an_always_slot_added_to_a_group_makes_room_and_is_pinned(
    start_hal0d_process: Hal0dProcessFactory, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    a = slot_toml("a", "reasoning", tmp_path, start="on_demand", group="gpu0")
    hal0d = await start_hal0d_process(slot=a + group_toml("gpu0", max_loaded=1))
    assert (await chat(http, hal0d, "reasoning"))[0] == 200
    with ProcessSampler(str(tmp_path)) as sampler:
        reloaded = await reload(hal0d, a + slot_toml("b", "chat", tmp_path, group="gpu0")
                                + group_toml("gpu0", max_loaded=1))
        assert reloaded["slots_added"] == ["b"]
        await state_is(http, hal0d, "b", "ready")
    assert (await views(http, hal0d))["a"]["state"] == "stopped"
    assert sampler.most_alive == 1
    status, answer = await chat(http, hal0d, "reasoning")
    assert status == 503 and "no room" in answer["error"]["message"], answer


async def test_a_reloaded_memory_mib_of_an_always_slot_counts_for_the_next_load(
    start_hal0d_process: Hal0dProcessFactory, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    def slots(pinned_mib: int) -> str:
        return (slot_toml("a", "reasoning", tmp_path, start="on_demand", group="gpu0",
                          memory_mib=4096)
                + slot_toml("b", "chat", tmp_path, group="gpu0", memory_mib=pinned_mib)
                + group_toml("gpu0", memory_mib=8192))

    hal0d = await start_hal0d_process(slot=slots(2048))
    await state_is(http, hal0d, "b", "ready")
    assert (await chat(http, hal0d, "reasoning"))[0] == 200  # 2 + 4 of 8 GiB
    async with http.post(f"{hal0d.url}/api/slots/a/unload") as resp:
        assert resp.status == 200
    reloaded = await reload(hal0d, slots(6144))
    assert reloaded["slots_changed"] == ["b"]
    status, answer = await chat(http, hal0d, "reasoning")  # 6 + 4 > 8 GiB
    assert status == 503 and "no room" in answer["error"]["message"], answer


async def test_a_route_slot_a_reload_removed_mid_request_hands_on_to_the_next(
    start_hal0d_process: Hal0dProcessFactory, upstream_app: Any, tmp_path: Path,
    http: aiohttp.ClientSession
) -> None:
    """A request's plan is the one it started with: while its first slot (it answers its probe,
    never a request) sits out first_byte_timeout_s, a reload removes the second. The second is
    handed on from (its lease refused: it is gone) like any slot that cannot take the request,
    and the third answers, where the removed slot's refusal used to end the request with a
    503."""
    async def never(_: web.Request) -> web.Response:
        await asyncio.sleep(60)
        return web.Response()

    silent = await upstream_app({"POST /v1/chat/completions": never})

    def slots(*names: str) -> str:
        members = ", ".join(f'"{name}"' for name in ("one", *names))
        served = ", ".join(f'{name} = "reasoning"' for name in ("one", *names))
        return (f'[[slots]]\nname = "one"\nupstream = "{silent}"\nmodels = ["one-only"]\n'
                + "".join(slot_toml(name, f"{name}-only", tmp_path) for name in names)
                + f'[[routes]]\nmodel = "qwen"\nslots = [{members}]\n'
                  f"served = {{ {served} }}\nfirst_byte_timeout_s = 3.0\n")

    hal0d = await start_hal0d_process(slot=slots("two", "three"))
    for name in ("two", "three"):
        await state_is(http, hal0d, name, "ready")
    stream = Stream("qwen")
    request = asyncio.create_task(open_stream(http, hal0d.url, stream, chat_body("qwen")))
    await asyncio.sleep(0.5)  # the request is at its first slot, waiting out the bound
    await reload(hal0d, slots("three"))
    assert not request.done()  # the reload came within the first slot's bound
    await asyncio.wait_for(request, STARTUP_S)
    assert stream.error is None and stream.raw.rstrip().endswith(b"data: [DONE]"), stream.raw
    # The line is written once the answer is out: the client may read [DONE] a moment before.
    def done_lines() -> list[dict[str, Any]]:
        return [line for line in hal0d.named("request.done") if line["model"] == "qwen"]

    [done] = await eventually(done_lines, 5.0, "the request's request.done line")
    assert (done["slot"], done["failover"]) == (
        "three", "one=first_byte_timeout,two=loading"), done
