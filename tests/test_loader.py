"""On-demand slots over real sockets and real child processes: a model (the stub, started as the
slot's command) is loaded by the first request, unloaded when idle and evicted to make room in
its group, without a request ever being cut; and a server's own output is logged as its own.
Loads and unloads through the admin API are in test_loader_api.py."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from structlog.testing import capture_logs

from hal0d.appkeys import LIFECYCLE
from hal0d.config import GroupConfig, SlotConfig
from tests.harness.client import CHAT, body, chat, state_is, views
from tests.harness.config import build_config, on_demand
from tests.harness.daemons import STARTUP_S, ServerFactory, start
from tests.harness.logs import logs_into_buffer
from tests.harness.poll import eventually
from tests.harness.ports import free_port
from tests.harness.processes import ProcessSampler, alive
from tests.harness.stubs import stub_command


class ExitWatch(threading.Thread):
    """When the first slot process the captured log names is gone (from /proc, every 5 ms, from
    a thread of its own so a busy event loop cannot delay the reading)."""

    def __init__(self, logs: list[dict[str, Any]]) -> None:
        super().__init__(daemon=True)
        self.logs = logs
        self.exited_at: float | None = None

    def run(self) -> None:
        deadline = time.monotonic() + 10
        pid = None
        while time.monotonic() < deadline:
            if pid is None:
                pid = next((entry["pid"] for entry in list(self.logs)
                            if entry["event"] == "slot.process_started"), None)
            elif not alive(pid):
                self.exited_at = time.monotonic()
                return
            time.sleep(0.005)


# -- load on demand --------------------------------------------------------------------------


async def test_an_on_demand_slot_rests_stopped_and_lists_its_models_with_their_state(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    hal0d = await start(start_hal0d, build_config(tmp_path, on_demand("a", tmp_path)))
    view = (await views(http, hal0d))["a"]
    assert (view["state"], view["pid"], view["start"]) == ("stopped", None, "on_demand")
    async with http.get(hal0d.make_url("/v1/models")) as resp:
        models = (await resp.json())["data"]
    assert [(m["id"], m["state"]) for m in models] == [("chat", "stopped")]
    async with http.get(hal0d.make_url("/readyz")) as resp:
        assert resp.status == 200  # nothing loaded, but a request would load it


async def test_twenty_requests_during_one_load_cause_one_load_and_are_served_in_arrival_order(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    slot = on_demand("a", tmp_path, "--startup-delay", "0.5", max_concurrent=1)
    hal0d = await start(start_hal0d, build_config(tmp_path, slot))
    served: list[int] = []

    async def one(i: int) -> None:
        status, answer = await chat(http, hal0d, "chat", text=f"r{i}")
        assert status == 200, answer
        served.append(i)

    with capture_logs() as logs:
        tasks = []
        for i in range(20):
            tasks.append(asyncio.create_task(one(i)))

            async def queued(n: int = i + 1) -> bool:
                view = (await views(http, hal0d))["a"]
                return view["queued"] + view["in_flight"] + len(served) >= n

            await eventually(queued, STARTUP_S, f"request {i} queued")
        await asyncio.gather(*tasks)
    assert served == list(range(20))
    events = [entry["event"] for entry in logs]
    assert events.count("slot.load_started") == 1
    assert events.count("slot.process_started") == 1
    assert events.count("slot.loaded") == 1
    assert (await views(http, hal0d))["a"]["state"] == "ready"


async def test_a_failed_load_answers_every_waiter_with_its_cause_at_once_and_backs_off(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    slot = on_demand("a", tmp_path, "--startup-delay", "0.3", "--fail-start",
                     "error: out of memory loading the model")
    hal0d = await start(start_hal0d, build_config(tmp_path, slot))
    answered: list[float] = []

    async def one() -> tuple[int, Any]:
        status, answer = await chat(http, hal0d, "chat")
        answered.append(time.monotonic())
        return status, answer

    with capture_logs() as logs:
        exit_watch = ExitWatch(logs)
        exit_watch.start()
        results = await asyncio.gather(*(one() for _ in range(20)))
        exit_watch.join(5)
        assert [status for status, _ in results] == [503] * 20
        for _, answer in results:
            assert answer["error"]["code"] == "slot.load_failed"
            assert "exited with code 1" in answer["error"]["message"]
            assert "out of memory loading the model" in answer["error"]["message"]
        # All of them within a second of the process exiting, not one per timeout.
        assert exit_watch.exited_at is not None
        assert max(answered) - exit_watch.exited_at < 1.0
        # Within the backoff a request is refused at once, without a second load.
        async with http.post(hal0d.make_url(CHAT), json=body("chat")) as resp:
            assert resp.status == 503
            assert int(resp.headers["Retry-After"]) >= 1
            assert (await resp.json())["error"]["code"] == "slot.load_failed"
    assert [entry["event"] for entry in logs].count("slot.load_started") == 1
    view = (await views(http, hal0d))["a"]
    assert view["state"] == "stopped" and "out of memory" in view["reason"]
    assert (view["in_flight"], view["queued"]) == (0, 0)


async def test_an_idle_slot_is_unloaded_and_the_next_request_loads_it_again(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    slot = on_demand("a", tmp_path, idle_unload_s=0.5)
    hal0d = await start(start_hal0d, build_config(tmp_path, slot))
    async with http.post(hal0d.make_url(CHAT), json=body("chat", stream=True)) as resp:
        assert resp.status == 200
        pid = (await views(http, hal0d))["a"]["pid"]
        assert (await resp.read()).endswith(b"data: [DONE]\n\n")
    ended = time.monotonic()

    async def gone() -> bool:
        return not alive(pid)

    await eventually(gone, 1.5, "the idle slot's process gone")
    assert time.monotonic() - ended < 1.5
    view = await state_is(http, hal0d, "a", "stopped", timeout=1.0)
    assert "idle" in view["reason"]
    status, _ = await chat(http, hal0d, "chat")
    assert status == 200
    again = (await views(http, hal0d))["a"]
    assert again["state"] == "ready" and again["pid"] not in (None, pid)
    assert (await chat(http, hal0d, "chat"))[0] == 200  # to a loaded slot: no load to wait for
    async with http.get(hal0d.make_url("/api/requests?limit=3")) as resp:
        rows = (await resp.json())["requests"]
    loaded, reloaded, first = rows
    assert first["load_ms"] > 0 and reloaded["load_ms"] > 0
    assert loaded["load_ms"] == 0


async def test_a_failed_load_names_the_last_lines_of_output_not_only_the_usage_hint(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """llama-server prints its real error two lines above `to show complete usage, run with
    -h`: the 503 names the last three lines."""
    script = ("import sys; print('error while handling argument \"--slot-save-path\": "
              "not a directory'); print(); print('usage:'); "
              "print('to show complete usage, run with -h'); sys.exit(1)")
    slot = SlotConfig(name="a", upstream=f"http://127.0.0.1:{free_port()}", models=("chat",),
                      command=(sys.executable, "-c", script), start="on_demand")
    hal0d = await start(start_hal0d, build_config(tmp_path, slot))
    status, answer = await chat(http, hal0d, "chat")
    assert status == 503 and answer["error"]["code"] == "slot.load_failed", answer
    message = answer["error"]["message"]
    assert "exited with code 1" in message
    assert 'not a directory | usage: | to show complete usage, run with -h' in message, message


async def test_no_room_says_what_is_true_of_a_group_with_no_other_slot_loaded(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    group = {"gpu0": GroupConfig("gpu0", free_memory_command=("echo", "100"))}
    slot = on_demand("a", tmp_path, group="gpu0", memory_mib=2048)
    hal0d = await start(start_hal0d, build_config(tmp_path, slot, groups=group))
    status, answer = await chat(http, hal0d, "chat")
    assert status == 503, answer
    message = answer["error"]["message"]
    assert "100 MiB free by free_memory_command, 2048 MiB needed" in message, message
    assert "no other slot of the group is loaded" in message and "always" not in message


async def test_a_port_another_program_listens_on_fails_the_load_instead_of_its_answer_counting(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession, aiohttp_server: Any
) -> None:
    """Another program on the slot's port would answer the probe while the slot's own process
    fails to bind: the load fails at once, naming the port, and the slot is never ready."""
    from aiohttp import web

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": []})

    other = web.Application()
    other.router.add_get("/v1/models", models)
    squatter = await aiohttp_server(other)
    slot = SlotConfig(name="a", upstream=f"http://127.0.0.1:{squatter.port}", models=("chat",),
                      command=stub_command(squatter.port, tmp_path / "a.log"), start="on_demand")
    hal0d = await start(start_hal0d, build_config(tmp_path, slot))
    with capture_logs() as logs:
        status, answer = await chat(http, hal0d, "chat")
    assert status == 503 and answer["error"]["code"] == "slot.load_failed", answer
    # The client is told the cause without the address; the operator's view names it.
    message = answer["error"]["message"]
    assert "[upstream] is already in use by another process" in message, message
    assert str(squatter.port) not in message, message
    assert f"127.0.0.1:{squatter.port} is already in use" in (await views(http, hal0d))["a"][
        "reason"]
    events = [entry["event"] for entry in logs]
    assert "slot.loaded" not in events and "slot.process_started" not in events
    assert (await views(http, hal0d))["a"]["state"] == "stopped"


async def test_an_idle_unload_carries_no_request_id_and_the_load_a_request_caused_does(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    slot = on_demand("a", tmp_path, idle_unload_s=0.3)
    hal0d = await start(start_hal0d, build_config(tmp_path, slot))
    with logs_into_buffer("json", "info") as buffer:
        async with http.post(hal0d.make_url(CHAT), json=body("chat"),
                             headers={"X-Request-Id": "the-one-request"}) as resp:
            assert resp.status == 200
        await state_is(http, hal0d, "a", "stopped", timeout=5)
        await eventually(lambda: '"slot.unloaded"' in buffer.getvalue(), 5, "the unload line")
    events = [orjson.loads(line) for line in buffer.getvalue().splitlines()]
    [started] = [e for e in events if e["event"] == "slot.load_started"]
    assert started.get("request_id") == "the-one-request"
    idle = [e for e in events if e["event"] in ("slot.unloaded", "slot.process_stopped")
            or e.get("reason") in ("unloading (idle)", "unloaded (idle)")]
    assert len(idle) == 4, idle  # stopping, the process stopped, unloaded, stopped
    assert [e for e in idle if "request_id" in e] == []


async def test_a_process_that_exits_while_idle_leaves_its_slot_stopped_not_restarting(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    hal0d = await start(start_hal0d, build_config(tmp_path, on_demand("a", tmp_path)))
    assert (await chat(http, hal0d, "chat"))[0] == 200
    pid = (await views(http, hal0d))["a"]["pid"]
    os.kill(pid, 9)
    view = await state_is(http, hal0d, "a", "stopped", timeout=5)
    assert "killed by signal 9 (SIGKILL)" in view["reason"]
    assert (await chat(http, hal0d, "chat"))[0] == 200  # loaded again on demand


# -- making room -----------------------------------------------------------------------------


async def test_max_loaded_1_swaps_models_and_never_runs_two_at_once(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    group = {"gpu0": GroupConfig("gpu0", max_loaded=1)}
    slots = [on_demand(name, tmp_path, group="gpu0") for name in ("a", "b", "c")]
    hal0d = await start(start_hal0d, build_config(tmp_path, *slots, groups=group))
    with ProcessSampler(str(tmp_path)) as sampler, capture_logs() as logs:
        for model in ("chat", "think-only", "chat", "tool", "think-only"):
            status, answer = await chat(http, hal0d, model)
            assert status == 200, answer
    assert sampler.samples > 50 and sampler.most_alive == 1
    states = {name: view["state"] for name, view in (await views(http, hal0d)).items()}
    assert states == {"a": "stopped", "b": "ready", "c": "stopped"}
    assert [entry["event"] for entry in logs].count("slot.loaded") == 5  # one load per swap


async def test_count_tokens_for_a_model_that_is_not_loaded_estimates_and_evicts_nothing(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """A count never swaps: with `a` serving in a group of one model at a time, a count for `b`
    (stopped) is an estimate that says so, and `a` stays loaded with `b` never started."""
    group = {"gpu0": GroupConfig("gpu0", max_loaded=1)}
    slots = [on_demand(name, tmp_path, group="gpu0") for name in ("a", "b")]
    hal0d = await start(start_hal0d, build_config(tmp_path, *slots, groups=group))
    status, answer = await chat(http, hal0d, "chat")
    assert status == 200, answer
    with capture_logs() as logs:
        async with http.post(hal0d.make_url("/v1/messages/count_tokens"), json={
                "model": "think-only", "messages": [{"role": "user", "content": "hi " * 40}]},
                ) as resp:
            counted = await resp.json()
            assert resp.status == 200, counted
            assert resp.headers["X-Hal0d-Token-Count"] == "estimate"
    assert counted["input_tokens"] > 0
    states = {name: view["state"] for name, view in (await views(http, hal0d)).items()}
    assert states == {"a": "ready", "b": "stopped"}
    assert "slot.load_started" not in [entry["event"] for entry in logs]
    assert not (tmp_path / "b.log").exists()


async def test_a_memory_budget_evicts_the_least_recently_used_and_free_memory_one_more(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    asked = tmp_path / "free-memory-asked"
    # Reports 1000 MiB free the first time it is asked, then plenty: one eviction more.
    free_memory = ("sh", "-c", f'if [ -e {asked} ]; then echo 99999; else touch {asked}; '
                   'echo 1000; fi')
    group = {"gpu0": GroupConfig("gpu0", memory_mib=10240)}
    slots = [on_demand("a", tmp_path, group="gpu0", memory_mib=4096),
             on_demand("b", tmp_path, group="gpu0", memory_mib=4096),
             on_demand("c", tmp_path, group="gpu0", memory_mib=6144)]
    hal0d = await start(start_hal0d, build_config(tmp_path, *slots, groups=group))
    for model in ("chat", "think-only"):
        assert (await chat(http, hal0d, model))[0] == 200
    assert {v["state"] for v in (await views(http, hal0d)).values()} == {"ready", "stopped"}
    with capture_logs() as logs:
        assert (await chat(http, hal0d, "tool"))[0] == 200  # 4 + 4 + 6 > 10: a goes
    states = {name: view["state"] for name, view in (await views(http, hal0d)).items()}
    assert states == {"a": "stopped", "b": "ready", "c": "ready"}
    evicting = [entry for entry in logs if entry["event"] == "slot.evicting"]
    assert [(e["slot"], e["for"]) for e in evicting] == [("a", "c")]

    # Now with the free-memory command: a's 4 GiB evicts b (the budget), then c (free memory).
    # fifo: c served the last request just now, which batch would give a moment to come back
    # in (and ask free_memory_command again after it).
    hal0d.app[LIFECYCLE].groups.replace({"gpu0": GroupConfig("gpu0", memory_mib=10240,
                                           free_memory_command=free_memory, policy="fifo")})
    with capture_logs() as logs:
        assert (await chat(http, hal0d, "chat"))[0] == 200
    states = {name: view["state"] for name, view in (await views(http, hal0d)).items()}
    assert states == {"a": "ready", "b": "stopped", "c": "stopped"}
    evicting = [entry for entry in logs if entry["event"] == "slot.evicting"]
    assert [e["slot"] for e in evicting] == ["b", "c"]
    assert "free_memory_command" in evicting[1]["why"]


async def test_a_busy_victim_drains_its_stream_before_it_is_evicted(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    # fifo: the victim is evicted while it streams (batch would let the stream end first).
    group = {"gpu0": GroupConfig("gpu0", max_loaded=1, policy="fifo")}
    slots = [on_demand("a", tmp_path, group="gpu0", models=("reasoning",)),
             on_demand("b", tmp_path, group="gpu0")]
    hal0d = await start(start_hal0d, build_config(tmp_path, *slots, groups=group))
    long = body("reasoning", "long", stream=True, max_tokens=150)
    async with http.post(hal0d.make_url(CHAT), json=long) as resp:
        assert resp.status == 200
        first = await resp.content.readany()
        swap = asyncio.create_task(chat(http, hal0d, "think-only"))
        await state_is(http, hal0d, "a", "stopping", timeout=5)
        # A new request for the victim queues behind the swap instead of being admitted.
        later = asyncio.create_task(chat(http, hal0d, "reasoning"))
        rest = await resp.read()
    whole = first + rest
    assert whole.endswith(b"data: [DONE]\n\n") and b"x_hal0_stall" not in whole
    assert (await swap)[0] == 200
    assert (await later)[0] == 200  # it loaded a again, in its turn
    states = {name: view["state"] for name, view in (await views(http, hal0d)).items()}
    assert states == {"a": "ready", "b": "stopped"}


# -- a server's output -----------------------------------------------------------------------


# A model server in a few lines: it prints while it loads, then a line per request it answers
# (as llama-server does), through the standard library's http.server.
_PRINTING_SERVER = """
import http.server, json, sys
print("loading model weights", flush=True)
class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, fmt, *args):
        print("served " + self.command + " " + self.path, flush=True)
    def _json(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        self._json({"object": "list", "data": []})
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self._json({"object": "chat.completion", "choices": [{"index": 0, "finish_reason":
                    "stop", "message": {"role": "assistant", "content": "hello"}}]})
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


async def test_a_servers_output_is_its_own_info_while_it_loads_and_debug_once_it_answers(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """Its lines never carry the id of the request that asked for the load (they are not about
    it), and the lines it prints for each request it answers are debug: at the default level
    they do not flood the journal."""
    port = free_port()
    slot = SlotConfig(name="a", upstream=f"http://127.0.0.1:{port}", models=("chat",),
                      command=(sys.executable, "-c", _PRINTING_SERVER, str(port)),
                      start="on_demand")
    hal0d = await start(start_hal0d, build_config(tmp_path, slot))
    with logs_into_buffer("json", "debug") as buffer:
        async with http.post(hal0d.make_url(CHAT), json=body("chat"),
                             headers={"X-Request-Id": "the-one-request"}) as resp:
            assert resp.status == 200
        await eventually(lambda: "served POST" in buffer.getvalue(), 5, "the request's line")
    events = [orjson.loads(line) for line in buffer.getvalue().splitlines()]
    printed = [e for e in events if e["event"] == "slot.process_output"]
    assert [e for e in printed if "request_id" in e] == []
    levels = {e["line"].split(" /")[0]: e["level"] for e in printed}
    assert levels["loading model weights"] == "info"
    assert levels["served POST"] == "debug", levels
