"""A load is one job, from its launch to its restored caches: what happens around a restore.

Each test runs hal0d in-process in front of real stub processes (real sockets) taught
llama-server's prompt cache, with a restore slowed down (`--slot-restore-delay`) or answered
with something other than llama-server's object (`--slot-odd-save`, `--slot-odd-restore`), and
acts while the restore is under way: a reload that replaces the command, an unload, another
model's request in a `max_loaded = 1` group. Each waits on what it means: the stub's own log
line saying the restore hangs, the slot's state in /api/slots, hal0d's log lines.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import MutableMapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from structlog.testing import capture_logs

from hal0d.appkeys import LIFECYCLE
from hal0d.config import Config, parse
from hal0d.lifecycle.machine import Event
from hal0d.lifecycle.slots import SlotState
from tests.harness.poll import eventually
from tests.harness.ports import free_port

CHAT = "/v1/chat/completions"
STARTUP_S = 15.0  # a Python process importing aiohttp, on a busy two-core box
LOAD_TIMEOUT_S = 20.0
RESTORE_DELAY_S = 4.0  # long enough to act in, short beside every bound
# A long first message: a warm turn reads almost none of it again.
OPENING = " ".join(f"line {n} of the repository's long context." for n in range(120))
ODD_ANSWERS = ("list", "string", "non_numeric")


def stub_slot(tmp_path: Path, name: str, model: str, *extra: str,
              log: str | None = None, **keys: Any) -> dict[str, Any]:
    """An on-demand stub slot that saves its prompt caches; `extra` goes to the stub."""
    port = free_port()
    command = [sys.executable, "-m", "hal0d", "stub", "--port", str(port), "--delay", "0.001",
               "--log", str(tmp_path / (log or f"{name}.log")),
               "--slot-save-path", "{prompt_cache_dir}", *extra]
    return {"name": name, "upstream": f"http://127.0.0.1:{port}", "models": [model],
            "command": command, "start": "on_demand", "prompt_cache": "save",
            "save_timeout_s": 10.0, "load_timeout_s": LOAD_TIMEOUT_S, **keys}


def config_of(tmp_path: Path, *slots: dict[str, Any], **groups: dict[str, Any]) -> Config:
    return parse({"slots": list(slots), "groups": groups,
                  "metrics": {"database": str(tmp_path / "history.sqlite3")}},
                 base_dir=tmp_path)


def conversation(turns: int) -> list[dict[str, str]]:
    said = [{"role": "user", "content": OPENING}]
    for turn in range(1, turns):
        said += [{"role": "assistant", "content": f"noted {turn}"},
                 {"role": "user", "content": f"next {turn}"}]
    return said


async def turn(http: aiohttp.ClientSession, hal0d: TestServer, model: str,
               turns: int = 1) -> tuple[int, dict[str, Any]]:
    async with http.post(hal0d.make_url(CHAT), json={
            "model": model, "messages": conversation(turns), "max_tokens": 4}) as resp:
        return resp.status, await resp.json()


def warm(body: dict[str, Any]) -> bool:
    usage = body["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return bool(cached > 0.9 * usage["prompt_tokens"])


async def unload(http: aiohttp.ClientSession, hal0d: TestServer, name: str) -> None:
    async with http.post(hal0d.make_url(f"/api/slots/{name}/unload")) as resp:
        assert resp.status == 200, await resp.text()


async def state_of(http: aiohttp.ClientSession, hal0d: TestServer, name: str) -> str:
    async with http.get(hal0d.make_url("/api/slots")) as resp:
        views = {view["name"]: view for view in (await resp.json())["slots"]}
    return str(views[name]["state"])


async def restore_hangs(log: Path) -> None:
    """Until the stub says a restore is under way and hangs (its --slot-restore-delay)."""
    await eventually(lambda: log.is_file() and "--slot-restore-delay" in log.read_text(),
                     STARTUP_S, f"a hanging restore in {log.name}")


def named(logs: Sequence[MutableMapping[str, Any]], event: str) -> list[MutableMapping[str, Any]]:
    return [line for line in logs if line["event"] == event]


def no_task_failed(logs: Sequence[MutableMapping[str, Any]]) -> None:
    failed = named(logs, "lifecycle.task_failed")
    assert not failed, failed


async def saved_once(http: aiohttp.ClientSession, hal0d: TestServer, model: str,
                     name: str) -> None:
    """The conversation's first turn, then an unload that saves its cache."""
    status, body = await turn(http, hal0d, model)
    assert status == 200, body
    await unload(http, hal0d, name)


async def test_a_reload_that_replaces_the_command_during_a_restore_ends_with_the_new_process(
    start_hal0d: Any, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    before = stub_slot(tmp_path, "a", "chat", "--slot-restore-delay", str(RESTORE_DELAY_S))
    # The new command: another log file (so its answers are told apart), no slow restore.
    command = before["command"]
    at = command.index("--log")
    after = {**before, "command": [*command[:at + 1], str(tmp_path / "new.log"),
                                   *command[at + 2:command.index("--slot-restore-delay")]]}
    with capture_logs() as logs:
        hal0d = await start_hal0d("http://unused", config=config_of(tmp_path, before))
        await saved_once(http, hal0d, "chat", "a")
        second = asyncio.create_task(turn(http, hal0d, "chat", 2))
        await restore_hangs(tmp_path / "a.log")
        started = time.monotonic()
        await hal0d.app[LIFECYCLE].apply(config_diff(hal0d, config_of(tmp_path, after)))
        status, body = await asyncio.wait_for(second, LOAD_TIMEOUT_S)
        assert status == 200, body
        assert time.monotonic() - started < LOAD_TIMEOUT_S
        # The new command's process answered it (its own log), and the slot serves on.
        assert "endpoint=chat status=200" in (tmp_path / "new.log").read_text()
        assert await state_of(http, hal0d, "a") == "ready"
        status, body = await turn(http, hal0d, "chat", 3)
        assert status == 200, body
    no_task_failed(logs)


def config_diff(hal0d: TestServer, config: Config) -> Any:
    from hal0d.lifecycle.reload import ConfigDiff

    manager = hal0d.app[LIFECYCLE]
    return ConfigDiff.between(manager.configs, config.slots, config.groups)


async def test_an_unload_during_a_restore_keeps_the_saved_cache_restorable(
    start_hal0d: Any, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    config = config_of(tmp_path, stub_slot(tmp_path, "a", "chat", "--slot-restore-delay",
                                           str(RESTORE_DELAY_S)))
    with capture_logs() as logs:
        hal0d = await start_hal0d("http://unused", config=config)
        await saved_once(http, hal0d, "chat", "a")
        second = asyncio.create_task(turn(http, hal0d, "chat", 2))
        await restore_hangs(tmp_path / "a.log")
        # A forced unload (a request waits for the load): the load and its restore are
        # cancelled whole, and the waiting request gets its 503.
        async with http.post(hal0d.make_url("/api/slots/a/unload?force=true")) as resp:
            assert resp.status == 200, await resp.text()
        status, body = await asyncio.wait_for(second, STARTUP_S)
        assert status == 503, body
        assert await state_of(http, hal0d, "a") == "stopped"
        # The saved cache is still there: the next load restores it.
        status, body = await turn(http, hal0d, "chat", 2)
        assert status == 200, body
        assert warm(body), body["usage"]
    assert not named(logs, "slot.cache_restore_failed")
    assert [line["slot"] for line in named(logs, "slot.cache_restored")] == ["a"]
    no_task_failed(logs)


@pytest.mark.parametrize("policy", ["fifo", "batch"])
async def test_another_models_request_during_a_restore_waits_for_its_turn_and_is_answered(
    start_hal0d: Any, tmp_path: Path, http: aiohttp.ClientSession, policy: str
) -> None:
    config = config_of(
        tmp_path,
        stub_slot(tmp_path, "a", "chat", "--slot-restore-delay", str(RESTORE_DELAY_S),
                  group="gpu"),
        stub_slot(tmp_path, "b", "tool", group="gpu"),
        gpu={"max_loaded": 1, "policy": policy, "max_wait_s": 1.0})
    with capture_logs() as logs:
        hal0d = await start_hal0d("http://unused", config=config)
        await saved_once(http, hal0d, "chat", "a")
        first = asyncio.create_task(turn(http, hal0d, "chat", 2))
        await restore_hangs(tmp_path / "a.log")
        other = asyncio.create_task(turn(http, hal0d, "tool"))
        (status_a, body_a), (status_b, body_b) = await asyncio.wait_for(
            asyncio.gather(first, other), 3 * LOAD_TIMEOUT_S)
        assert (status_a, status_b) == (200, 200), (body_a, body_b)
        assert warm(body_a), body_a["usage"]
    assert not named(logs, "slot.no_room") and not named(logs, "slot.load_failed")
    no_task_failed(logs)


@pytest.mark.parametrize("odd", ODD_ANSWERS)
async def test_an_odd_save_answer_is_a_failed_save_and_the_group_loads_on(
    start_hal0d: Any, tmp_path: Path, http: aiohttp.ClientSession, odd: str
) -> None:
    config = config_of(
        tmp_path, stub_slot(tmp_path, "a", "chat", "--slot-odd-save", odd, group="gpu",
                            save_timeout_s=2.0),
        stub_slot(tmp_path, "b", "tool", group="gpu"),
        gpu={"max_loaded": 1, "policy": "fifo"})
    with capture_logs() as logs:
        hal0d = await start_hal0d("http://unused", config=config)
        status, body = await turn(http, hal0d, "chat")
        assert status == 200, body
        started = time.monotonic()
        status, body = await turn(http, hal0d, "tool")  # evicts a: its save is answered oddly
        assert status == 200, body
        assert time.monotonic() - started < 2.0 + STARTUP_S
        assert await state_of(http, hal0d, "a") == "stopped"
    [failed] = named(logs, "slot.cache_save_failed")
    assert failed["slot"] == "a" and "POST /slots/0?action=save answered" in failed["reason"]
    no_task_failed(logs)


@pytest.mark.parametrize("odd", [*ODD_ANSWERS, "hang"])
async def test_an_odd_or_hanging_restore_answer_is_a_failed_restore_and_the_load_goes_on_cold(
    start_hal0d: Any, tmp_path: Path, http: aiohttp.ClientSession, odd: str
) -> None:
    fault = (["--slot-restore-delay", "60"] if odd == "hang" else ["--slot-odd-restore", odd])
    config = config_of(
        tmp_path, stub_slot(tmp_path, "a", "chat", *fault, group="gpu", save_timeout_s=1.0),
        stub_slot(tmp_path, "b", "tool", group="gpu"),
        gpu={"max_loaded": 1, "policy": "fifo"})
    with capture_logs() as logs:
        hal0d = await start_hal0d("http://unused", config=config)
        await saved_once(http, hal0d, "chat", "a")
        started = time.monotonic()
        status, body = await turn(http, hal0d, "chat", 2)  # loads a: the restore fails
        assert status == 200, body
        assert time.monotonic() - started < 1.0 + STARTUP_S
        assert not warm(body)
        status, body = await turn(http, hal0d, "tool")  # the group's next load is not stuck
        assert status == 200, body
    [failed] = named(logs, "slot.cache_restore_failed")
    assert failed["slot"] == "a"
    assert ("save_timeout_s = 1" if odd == "hang" else "action=restore answered") in (
        failed["reason"])
    no_task_failed(logs)


async def test_an_event_from_a_superseded_job_changes_no_slots_state(
    start_hal0d: Any, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    config = config_of(tmp_path, stub_slot(tmp_path, "a", "chat"))
    with capture_logs() as logs:
        hal0d = await start_hal0d("http://unused", config=config)
        manager = hal0d.app[LIFECYCLE]
        runner = manager.runners["a"]
        status, body = await turn(http, hal0d, "chat")
        assert status == 200, body
        loaded_by = runner.job_generation  # the job that loaded it
        await unload(http, hal0d, "a")
        slot = hal0d.app[LIFECYCLE].table["a"]
        assert slot.state is SlotState.STOPPED
        # That job's answer, late: about a process that is gone.
        assert not manager.report(runner, loaded_by, Event.ANSWERED)
        assert slot.state is SlotState.STOPPED and runner.child is None
        # The slot loads on as ever.
        status, body = await turn(http, hal0d, "chat", 2)
        assert status == 200, body
    [stale] = named(logs, "lifecycle.stale_event")
    assert stale["told"] == "answered" and stale["generation"] == loaded_by
    no_task_failed(logs)



async def test_a_swap_is_measured_whole_and_the_group_shows_its_cost_its_turns_and_waits(
    start_hal0d: Any, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """A swap costs the victim's drain and save, the load and the restore: /api/slots shows
    each group's measured swap cost and its share of the time, the loads waiting for their
    turn in order, and how long each model's oldest request has waited."""
    config = config_of(
        tmp_path,
        stub_slot(tmp_path, "a", "chat", "--slot-restore-delay", "1.0", group="gpu"),
        stub_slot(tmp_path, "b", "tool", "--startup-delay", "0.5", group="gpu"),
        gpu={"max_loaded": 1, "policy": "fifo"})
    with capture_logs() as logs:
        hal0d = await start_hal0d("http://unused", config=config)
        await saved_once(http, hal0d, "chat", "a")
        status, body = await turn(http, hal0d, "tool")  # a's cache is saved; b loads
        assert status == 200, body
        first = asyncio.create_task(turn(http, hal0d, "chat", 2))  # b goes, a restores
        await restore_hangs(tmp_path / "a.log")
        other = asyncio.create_task(turn(http, hal0d, "tool", 2))

        async def waiting() -> dict[str, Any]:
            [group] = await groups(http, hal0d)
            assert group["turn_order"] == ["b"], group
            return dict(group)

        during = await eventually(waiting, STARTUP_S, "b's load waiting for its turn")
        assert during["loaded"] == ["a"] and set(during["longest_wait_s"]) == {"a", "b"}
        for task in (first, other):
            status, body = await asyncio.wait_for(task, LOAD_TIMEOUT_S)
            assert status == 200, body
        [group] = await groups(http, hal0d)
    # b's first load found the room free (a was unloaded): no swap. Then a for b (a's restore
    # in it), and b for a (b's slow start in it).
    measured = named(logs, "group.swap_measured")
    assert [line["slot"] for line in measured] == ["a", "b"], measured
    assert measured[0]["cost_s"] >= 1.0 and measured[1]["cost_s"] >= 0.5
    assert group["swaps"] == 2 and group["swap_cost_s"] == measured[-1]["median_s"]
    assert 0 < group["swap_share"] <= 1 and group["turn_order"] == []
    assert group["loaded"] == ["b"] and group["longest_wait_s"] == {}
    no_task_failed(logs)


async def groups(http: aiohttp.ClientSession, hal0d: TestServer) -> list[dict[str, Any]]:
    async with http.get(hal0d.make_url("/api/slots")) as resp:
        return list((await resp.json())["groups"])
