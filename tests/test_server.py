"""`hal0d serve` as a real process: graceful shutdown on SIGTERM, reload on SIGHUP.

hal0d runs as a subprocess in front of the stub upstream (served by the test's own event loop)
and is steered with real signals, the way systemd steers it.
"""

from __future__ import annotations

import asyncio
import signal
import sqlite3
import textwrap
import time
from contextlib import closing
from pathlib import Path

import aiohttp
import orjson
import pytest

from hal0d import config as configuration
from tests.harness.client import Stream, chat, chat_body, open_stream
from tests.harness.config import GRACE_S, config_text
from tests.harness.daemons import EXIT_SLACK_S, Hal0dProcessFactory, spawn
from tests.harness.observe import after_the_stream
from tests.harness.poll import eventually
from tests.harness.ports import free_port
from tests.harness.stubs import Stub, StubFactory

TOKEN_DELAY_S = 0.02  # the stub's pace: 50 tokens a second per stream
SHORT_MAX_TOKENS = 30  # about 0.6 s of tokens: in flight at SIGTERM, done well within the grace
LONG_MAX_TOKENS = 1_000_000  # with the message "long": far beyond the grace


@pytest.fixture
async def stub(start_stub: StubFactory) -> Stub:
    return await start_stub(delay=TOKEN_DELAY_S)


async def served_models(http: aiohttp.ClientSession, url: str) -> list[str]:
    async with http.get(f"{url}/v1/models") as response:
        return [item["id"] for item in (await response.json())["data"]]


async def test_sigterm_drains_short_streams_and_ends_long_ones_with_a_terminal_frame(
    stub: Stub, start_hal0d_process: Hal0dProcessFactory, http: aiohttp.ClientSession,
    tmp_path: Path
) -> None:
    """20 open streams at SIGTERM: the 10 short ones finish on their own within the grace, the
    10 long ones get the stall-guard frame with reason shutdown and [DONE]; none ends without
    one of the two; new connections are refused at once; exit code 0 soon after the grace."""
    hal0d = await start_hal0d_process(stub.url)
    short = [Stream(f"short-{i}") for i in range(10)]
    long = [Stream(f"long-{i}") for i in range(10)]
    tasks = [
        *(asyncio.create_task(open_stream(http, hal0d.url, s, chat_body(
            "reasoning", max_tokens=SHORT_MAX_TOKENS))) for s in short),
        *(asyncio.create_task(open_stream(http, hal0d.url, s, chat_body(
            "reasoning", content="long", max_tokens=LONG_MAX_TOKENS))) for s in long),
    ]
    async with asyncio.timeout(10):
        for stream in (*short, *long):
            await stream.first_chunk.wait()
    assert all(not task.done() for task in tasks), "every stream must be open at SIGTERM"

    hal0d.send(signal.SIGTERM)
    sent = time.monotonic()
    await hal0d.wait_for_event("server.stopping")

    async def refused() -> bool:
        try:
            async with http.get(f"{hal0d.url}/healthz"):
                return False
        except aiohttp.ServerDisconnectedError:
            return False  # a pooled keep-alive connection the stop closed: ask again
        except aiohttp.ClientConnectorError:
            return True

    await eventually(refused, GRACE_S, "the listener closed while the streams still run")
    with pytest.raises(aiohttp.ClientConnectorError):
        async with http.get(f"{hal0d.url}/healthz"):
            pass
    async with asyncio.timeout(GRACE_S + EXIT_SLACK_S):
        code = await hal0d.process.wait()
    exited = time.monotonic() - sent
    await asyncio.gather(*tasks)

    assert code == 0, hal0d.log.read_text()
    assert exited < GRACE_S + EXIT_SLACK_S
    for stream in short:
        assert stream.error is None, stream.error
        assert stream.finished_normally(), (stream.name, stream.data[-3:])
        assert stream.ended_at > sent  # it was in flight at SIGTERM and drained, not cut
    for stream in long:
        assert stream.error is None, stream.error
        assert stream.done, (stream.name, stream.data[-3:])
        stall = stream.stall()
        assert stall is not None and stall["reason"] == "shutdown", (stream.name, stall)
        assert stream.ended_at - sent >= GRACE_S - 0.1  # they got the whole grace
    # No stream ended without either ending (the assertions above cover all 20).
    events = hal0d.events()
    names = [event["event"] for event in events]
    assert names.index("server.stopping") < names.index("server.grace_expired")
    assert names[-1] == "server.stopped"
    expired = hal0d.named("server.grace_expired")[0]
    assert expired["streams"] == len(long)
    done = [e for e in hal0d.named("request.done") if e["path"] == "/v1/chat/completions"]
    assert sorted(e["error_code"] or "ok" for e in done) == (
        ["ok"] * len(short) + ["stream_stall_shutdown"] * len(long)
    )
    # The request history is flushed on the way out: a row for each of the 20 streams.
    with closing(sqlite3.connect(tmp_path / "history.sqlite3")) as db:
        rows = db.execute(
            "SELECT error_code, COUNT(*) FROM requests WHERE endpoint = '/v1/chat/completions'"
            " GROUP BY error_code ORDER BY error_code"
        ).fetchall()
    assert rows == [(None, len(short)), ("stream_stall_shutdown", len(long))]


async def test_sigterm_ends_an_anthropic_stream_with_an_error_event(
    stub: Stub, start_hal0d_process: Hal0dProcessFactory, http: aiohttp.ClientSession
) -> None:
    """The Anthropic surface's terminal frame: one `event: error` naming the shutdown, and no
    message_stop that would make the cut answer look complete."""
    hal0d = await start_hal0d_process(stub.url, grace_s=0.5)
    body = {"model": "reasoning", "max_tokens": LONG_MAX_TOKENS, "stream": True,
            "messages": [{"role": "user", "content": "long"}]}
    raw = b""
    async with http.post(f"{hal0d.url}/v1/messages", json=body) as response:
        assert response.status == 200
        async for data in response.content.iter_any():
            if not raw:
                hal0d.send(signal.SIGTERM)
            raw += data
    assert await hal0d.process.wait() == 0
    frames = [frame for frame in raw.replace(b"\r\n", b"\n").split(b"\n\n") if frame.strip()]
    last = dict(line.split(b": ", 1) for line in frames[-1].split(b"\n"))
    assert last[b"event"] == b"error"
    error = orjson.loads(last[b"data"])["error"]
    assert "shutting down" in error["message"] and '"reason":"shutdown"' in error["message"]
    assert b"message_stop" not in raw


async def test_a_second_sigterm_ends_the_streams_at_once(
    stub: Stub, start_hal0d_process: Hal0dProcessFactory, http: aiohttp.ClientSession
) -> None:
    hal0d = await start_hal0d_process(stub.url, grace_s=30)
    stream = Stream("long")
    task = asyncio.create_task(open_stream(http, hal0d.url, stream, chat_body(
        "reasoning", content="long", max_tokens=LONG_MAX_TOKENS)))
    await stream.first_chunk.wait()
    hal0d.send(signal.SIGTERM)
    await hal0d.wait_for_event("server.stopping")
    hal0d.send(signal.SIGINT)
    async with asyncio.timeout(EXIT_SLACK_S):
        assert await hal0d.process.wait() == 0
    await task
    stall = stream.stall()
    assert stream.done and stall is not None and stall["reason"] == "shutdown"
    assert hal0d.named("server.grace_cut_short")


async def test_sighup_with_a_broken_config_keeps_serving_on_the_old_one(
    stub: Stub, start_hal0d_process: Hal0dProcessFactory, http: aiohttp.ClientSession
) -> None:
    hal0d = await start_hal0d_process(stub.url)
    before = await served_models(http, hal0d.url)
    good = hal0d.config.read_text()
    hal0d.config.write_text(good.replace('models = ["reasoning", "chat"]',
                                         'models = ["reasoning", "chat", "new"]\nbogus = 1')
                            .replace("shutdown_grace_s = 1.5", 'shutdown_grace_s = "soon"'))
    hal0d.send(signal.SIGHUP)
    failed = await hal0d.wait_for_event("config.reload_failed")

    # A line per problem, logged before the refusal that counts them.
    problems = [line["problem"] for line in hal0d.named("config.reload_problem")]
    assert failed["level"] == "error" and failed["problems"] == len(problems) == 2
    assert any("slots[0].bogus: unknown key" in problem for problem in problems)
    assert any("server.shutdown_grace_s" in problem for problem in problems)
    assert not hal0d.named("config.reloaded")
    assert await served_models(http, hal0d.url) == before
    status, answer = await chat(http, hal0d, "chat")
    assert status == 200, answer
    status, _ = await chat(http, hal0d, "new")
    assert status == 404  # still the old routing table

    # Not even a file that is not TOML any more takes it down.
    hal0d.config.write_text("[server\n")
    hal0d.send(signal.SIGHUP)
    await hal0d.wait_for_count("config.reload_failed", 2)
    assert "invalid TOML" in hal0d.named("config.reload_problem")[-1]["problem"]
    assert (await chat(http, hal0d, "chat"))[0] == 200
    assert hal0d.process.returncode is None

    # Nor a valid file with nothing to serve: the rule `serve` and check-config apply at start.
    hal0d.config.write_text(good.split("[[slots]]")[0])
    hal0d.send(signal.SIGHUP)
    await hal0d.wait_for_count("config.reload_failed", 3)
    assert "hal0d would serve nothing" in hal0d.named("config.reload_problem")[-1]["problem"]
    assert await served_models(http, hal0d.url) == before
    assert (await chat(http, hal0d, "chat"))[0] == 200


async def test_sighup_applies_a_changed_config_to_new_requests_only(
    stub: Stub, start_hal0d_process: Hal0dProcessFactory, http: aiohttp.ClientSession
) -> None:
    """A valid reload: a new alias and a new slot serve at once; a tighter stall-guard bound
    applies to a stream started after the reload, not to the one already running."""
    hal0d = await start_hal0d_process(stub.url)
    running = Stream("started before the reload")
    task = asyncio.create_task(open_stream(http, hal0d.url, running, chat_body(
        "reasoning", max_tokens=60)))  # about 1.2 s
    await running.first_chunk.wait()

    port = hal0d.port + 1  # changing the port needs a restart: it must be refused, loudly
    hal0d.config.write_text(
        hal0d.config.read_text().replace(f"port = {hal0d.port}", f"port = {port}")
        + textwrap.dedent(f"""
            [dispatcher]
            stream_total_timeout_s = 0.4

            [[slots]]
            name = "second"
            upstream = "{stub.url}"
            models = ["think-only"]

            [models]
            "gpt-*" = "chat"
        """)
    )
    hal0d.send(signal.SIGHUP)
    reloaded = await hal0d.wait_for_event("config.reloaded")
    assert reloaded["slots_added"] == ["second"]
    restart = hal0d.named("config.restart_needed")
    assert restart and restart[0]["keys"] == ["server.port"] and restart[0]["level"] == "warning"

    assert "think-only" in await served_models(http, hal0d.url)
    status, answer = await chat(http, hal0d, "gpt-4o")  # the new alias
    assert status == 200 and answer["model"] == "chat", answer
    status, answer = await chat(http, hal0d, "think-only")  # the new slot
    assert status == 200, answer

    after = Stream("started after the reload")
    await open_stream(http, hal0d.url, after, chat_body(
        "reasoning", content="long", max_tokens=LONG_MAX_TOKENS))
    stall = after.stall()
    assert stall is not None and stall["reason"] == "total", after.data[-2:]
    assert stall["stream_total_timeout_s"] == 0.4

    await task
    assert running.finished_normally(), running.data[-2:]  # the old Runtime's 900 s bound
    # The port change was not applied: hal0d still listens where it did.
    async with http.get(f"{hal0d.url}/healthz") as response:
        assert response.status == 200


async def test_a_reloaded_slot_command_replaces_its_process_once_its_streams_are_done(
    stub: Stub, start_hal0d_process: Hal0dProcessFactory, http: aiohttp.ClientSession,
    tmp_path: Path
) -> None:
    """A reload of an `always` slot's command: the old process keeps serving the stream it has
    (the slot waits in `starting`), then it is stopped and the new command serves the next
    request."""
    port = free_port()
    command = ["hal0d", "stub", "--port", str(port), "--delay", str(TOKEN_DELAY_S)]
    slot = f"""
        [[slots]]
        name = "proc"
        upstream = "http://127.0.0.1:{port}"
        models = ["reasoning", "chat"]
        command = {orjson.dumps(command).decode()}
    """
    hal0d = await start_hal0d_process(stub.url, slot=slot)

    async def slot_state() -> str:
        async with http.get(f"{hal0d.url}/api/slots") as response:
            return str((await response.json())["slots"][0]["state"])

    async def slot_ready() -> bool:
        return await slot_state() == "ready"

    await eventually(slot_ready, 15, "the slot process ready")
    running = Stream("on the old process")
    task = asyncio.create_task(open_stream(http, hal0d.url, running, chat_body(
        "reasoning", max_tokens=60)))  # about 1.2 s
    await running.first_chunk.wait()

    new_log = tmp_path / "new-process.log"
    hal0d.config.write_text(hal0d.config.read_text().replace(
        orjson.dumps(command).decode(),
        orjson.dumps([*command, "--log", str(new_log)]).decode(),
    ))
    hal0d.send(signal.SIGHUP)
    reloaded = await hal0d.wait_for_event("config.reloaded")
    assert reloaded["slots_changed"] == ["proc"]
    assert await slot_state() == "starting"  # new requests wait for the new process
    assert hal0d.named("slot.draining")[0]["in_flight"] == 1

    await task
    assert running.finished_normally(), running.data[-2:]
    await eventually(slot_ready, 15, "the slot process ready")
    status, answer = await chat(http, hal0d, "chat")
    assert status == 200, answer
    assert "start rid=" in new_log.read_text()  # served by the reloaded command
    assert await after_the_stream(http, hal0d, "slot.process_stopped", "proc")


def test_two_configs_in_one_folder_keep_two_histories(tmp_path: Path) -> None:
    slot = '[[slots]]\nname = "a"\nupstream = "http://127.0.0.1:9"\nmodels = ["m"]\n'
    (tmp_path / "two.toml").write_text(slot)
    (tmp_path / "keys.toml").write_text(slot)
    two, keys = (configuration.load(tmp_path / name) for name in ("two.toml", "keys.toml"))
    assert two.database_path() == tmp_path / "two.history.sqlite3"
    assert keys.database_path() == tmp_path / "keys.history.sqlite3"


async def test_a_second_hal0d_on_one_history_is_refused_with_one_clear_line(
    stub: Stub, start_hal0d_process: Hal0dProcessFactory, tmp_path: Path
) -> None:
    first = await start_hal0d_process(stub.url)
    other = tmp_path / "other"
    other.mkdir()
    config = other / "hal0d.toml"
    config.write_text(config_text(stub.url, free_port(), tmp_path))  # the same database
    second = await spawn(config, 0, other / "hal0d.log")
    assert await asyncio.wait_for(second.process.wait(), 20) == 1
    refused = second.named("server.start_failed")
    assert len(refused) == 1, second.log.read_text()
    assert f"in use by another hal0d (pid {first.process.pid})" in refused[0]["error"]
    assert "exception" not in refused[0]  # one line, no traceback
    assert first.process.returncode is None  # the first one serves on
