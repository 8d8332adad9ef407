"""File descriptors and the listen backlog, on a real `hal0d serve` process.

hal0d runs as a subprocess with the open-files limit the test gives it (setrlimit between fork
and exec, as systemd or `prlimit` would), in front of the stub upstream served by the test's own
event loop. What it does with its descriptors is read from /proc/<pid>, its listening socket
from `ss` (iproute2), and its log lines from its JSON log.
"""

from __future__ import annotations

import asyncio
import os
import re
import resource
import shutil
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from hal0d import config
from hal0d.front.listeners import somaxconn
from hal0d.server import keep_restart_keys, restart_needed
from tests.harness.client import chat_body
from tests.harness.config import config_text
from tests.harness.daemons import Hal0dProcess, spawn
from tests.harness.poll import eventually
from tests.harness.ports import free_port
from tests.harness.stubs import Stub, StubFactory

STUB_DELAY_S = 0.05  # "chatty" streams a token every 50 ms, forever: a stream stays open
LOW_LIMIT = 64  # soft = hard: room for hal0d at rest plus a couple of dozen sockets
REPORT_WINDOW_S = 5.0  # descriptors.REPORT_EVERY_S
SETTLE_S = 5.0
ANTHROPIC_BODY = {
    "model": "chat", "max_tokens": 64, "stream": True,
    "messages": [{"role": "user", "content": "hi"}],
}

Launcher = Callable[..., Awaitable[Hal0dProcess]]


@pytest.fixture
async def stub(start_stub: StubFactory) -> Stub:
    return await start_stub(delay=STUB_DELAY_S)


def nofile(soft: int, hard: int) -> Callable[[], None]:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    return limit


@pytest.fixture
async def launch(tmp_path: Path) -> AsyncIterator[Launcher]:
    started: list[Hal0dProcess] = []

    async def start(stub: Stub, *, soft: int, hard: int, backlog: int | None = None,
                    slot: str = "") -> Hal0dProcess:
        port = free_port()
        config = tmp_path / "hal0d.toml"
        text = config_text(stub.url, port, tmp_path, slot=slot)
        if backlog is not None:
            text = text.replace("[server]\n", f"[server]\nbacklog = {backlog}\n", 1)
        config.write_text(text)
        hal0d = await spawn(config, port, tmp_path / "hal0d.log",
                            preexec_fn=nofile(soft, hard))  # setrlimit alone: safe after fork
        started.append(hal0d)
        await hal0d.wait_for_event("server.started", timeout=10)
        return hal0d

    yield start
    for hal0d in started:
        if hal0d.process.returncode is None:
            hal0d.process.kill()
            await hal0d.process.wait()


def proc_limits(pid: int) -> tuple[int, int]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError("no 'Max open files' line")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- the limit -------------------------------------------------------------------------------


async def test_a_low_soft_open_files_limit_is_raised_to_the_hard_one_at_start(
    launch: Launcher, stub: Stub
) -> None:
    """Started as systemd starts services (soft 1024, a higher hard limit), hal0d runs with the
    hard limit as its soft one and logs both."""
    hal0d = await launch(stub, soft=1024, hard=4096)
    assert proc_limits(hal0d.process.pid) == (4096, 4096)
    raised = hal0d.named("server.fd_limit_raised")
    assert [(e["soft"], e["new"], e["hard"]) for e in raised] == [(1024, 4096, 4096)]


async def test_no_raise_is_logged_when_the_soft_limit_is_the_hard_one(
    launch: Launcher, stub: Stub
) -> None:
    hal0d = await launch(stub, soft=4096, hard=4096)
    assert proc_limits(hal0d.process.pid) == (4096, 4096)
    assert hal0d.named("server.fd_limit_raised") == []


# -- the backlog -----------------------------------------------------------------------------


def listen_queue(port: int) -> int:
    """The backlog of the socket listening on `port`: Send-Q of a LISTEN row in `ss -ltn`."""
    ss = shutil.which("ss") or next(
        (p for p in ("/usr/sbin/ss", "/sbin/ss", "/usr/bin/ss") if os.path.exists(p)), None
    )
    if ss is None:
        pytest.fail("ss (iproute2) is not installed; .ci/run installs it")
    out = subprocess.run([ss, "-Hltn", f"sport = :{port}"], capture_output=True, text=True,
                         check=True, timeout=10).stdout
    rows = [line.split() for line in out.splitlines() if line.strip()]
    assert len(rows) == 1, out
    return int(rows[0][2])


@pytest.mark.parametrize("value", [0, 65536, "2048", 1.5])
def test_a_backlog_outside_1_to_65535_or_not_an_integer_is_refused(value: object) -> None:
    with pytest.raises(config.ConfigError) as caught:
        config.parse({"server": {"backlog": value}})
    assert [p for p in caught.value.problems if p.startswith("server.backlog: ")], caught.value


def test_the_backlog_needs_a_restart_and_keeps_its_running_value_on_reload() -> None:
    running = config.parse({})
    loaded = config.parse({"server": {"backlog": 64}})
    assert running.server.backlog == 2048
    assert restart_needed(running, loaded) == ["server.backlog"]
    assert keep_restart_keys(running, loaded).server.backlog == 2048


async def test_the_configured_backlog_reaches_the_listening_socket(
    launch: Launcher, stub: Stub
) -> None:
    ceiling = somaxconn()
    assert ceiling is not None
    backlog = min(777, ceiling)
    hal0d = await launch(stub, soft=4096, hard=4096, backlog=backlog)
    assert listen_queue(hal0d.port) == backlog
    assert hal0d.named("server.backlog_clipped") == []


async def test_a_backlog_above_somaxconn_is_clipped_by_the_kernel_and_the_log_says_so(
    launch: Launcher, stub: Stub
) -> None:
    ceiling = somaxconn()
    assert ceiling is not None
    if ceiling >= 65535:
        pytest.skip(f"somaxconn is {ceiling}: no valid backlog exceeds it")
    hal0d = await launch(stub, soft=4096, hard=4096, backlog=ceiling + 1)
    assert listen_queue(hal0d.port) == ceiling
    clipped = hal0d.named("server.backlog_clipped")
    assert [(e["requested"], e["somaxconn"]) for e in clipped] == [(ceiling + 1, ceiling)]


# -- running out -----------------------------------------------------------------------------


class Holders:
    """What holds hal0d's descriptors from the test's side: open streams (a client socket and
    an upstream socket each) and idle connections (a client socket each)."""

    def __init__(self, hal0d: Hal0dProcess, limit: int) -> None:
        self.hal0d = hal0d
        self.limit = limit
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                          timeout=aiohttp.ClientTimeout(total=30))
        self.streams: list[aiohttp.ClientResponse] = []
        self.idle: list[socket.socket] = []

    def free(self) -> int:
        return self.limit - open_fds(self.hal0d.process.pid)

    async def open_stream(self) -> None:
        response = await self.http.post(f"{self.hal0d.url}/v1/chat/completions",
                                        json=chat_body("chatty", max_tokens=100_000))
        assert response.status == 200, await response.text()
        assert (await response.content.readline()).startswith(b"data:")
        self.streams.append(response)

    async def open_idle(self) -> None:
        before = open_fds(self.hal0d.process.pid)
        self.idle.append(socket.create_connection(("127.0.0.1", self.hal0d.port), timeout=5))
        await eventually(lambda: open_fds(self.hal0d.process.pid) > before, SETTLE_S,
                    "hal0d accepted the idle connection")

    async def fill_to(self, free: int) -> None:
        """Hold hal0d's descriptors until exactly `free` are left."""
        for _ in range(self.limit):
            left = self.free()
            assert left >= free, f"{left} free, wanted {free}"
            if left == free:
                return
            if left - free >= 3:
                await self.open_stream()
            else:
                await self.open_idle()
        raise AssertionError(f"could not bring hal0d to {free} free descriptors")

    async def release(self) -> None:
        for response in self.streams:
            response.close()
        for sock in self.idle:
            sock.close()
        self.streams.clear()
        self.idle.clear()
        await self.http.close()


@pytest.fixture
async def exhausted(launch: Launcher, stub: Stub) -> AsyncIterator[Holders]:
    """hal0d under soft = hard = LOW_LIMIT, with nearly all of its descriptors held."""
    hal0d = await launch(stub, soft=LOW_LIMIT, hard=LOW_LIMIT, slot=f"""
        [[slots]]
        name = "llm"
        upstream = "{stub.url}"
        models = ["chat", "chatty"]
        max_concurrent = {LOW_LIMIT}
    """)
    resting = open_fds(hal0d.process.pid)
    assert resting <= LOW_LIMIT - 8, f"hal0d holds {resting} descriptors at rest"
    holders = Holders(hal0d, LOW_LIMIT)
    try:
        yield holders
    finally:
        await holders.release()


async def refused(url: str, body: dict[str, Any]) -> tuple[int, dict[str, str], dict[str, Any]]:
    """One request on a connection of its own, closed after the answer (its socket on hal0d's
    side is given back at once)."""
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(force_close=True), timeout=aiohttp.ClientTimeout(total=10)
    ) as http, http.post(url, json=body) as response:
        return response.status, dict(response.headers), orjson.loads(await response.read())


async def slots_idle(url: str) -> bool:
    async with aiohttp.ClientSession() as http, http.get(f"{url}/api/slots") as response:
        slots = (await response.json())["slots"]
    return all(slot["in_flight"] == 0 and slot["queued"] == 0 for slot in slots)


async def test_out_of_descriptors_a_request_gets_503_in_its_envelope_logged_once_and_counted(
    exhausted: Holders,
) -> None:
    """With one descriptor left, hal0d accepts the client and cannot open the upstream socket:
    503 with Retry-After in the OpenAI and the Anthropic envelope (never 502 or 500), one
    `server.fd_exhausted` line for the burst and a later one with the count of the rest, the
    Prometheus counter; once descriptors are free again, requests succeed and no slot stays
    busy."""
    hal0d = exhausted.hal0d
    await exhausted.fill_to(1)
    answers = []
    for path, body in (
        ("/v1/chat/completions", chat_body("chat")),
        ("/llm/v1/messages", ANTHROPIC_BODY),
        ("/v1/chat/completions", chat_body("chat")),
    ):
        answers.append((path, *await refused(hal0d.url + path, body)))
        # hal0d closes its end of that connection: the last descriptor is free again.
        await eventually(lambda: exhausted.free() == 1, SETTLE_S, "the refused connection closed")

    for path, status, headers, body in answers:
        assert status == 503, (path, body)
        assert int(headers["Retry-After"]) >= 1
        if path == "/llm/v1/messages":
            assert body["type"] == "error"
            assert body["error"]["type"] == "overloaded_error"
            assert "file descriptor" in body["error"]["message"]
        else:
            assert body["error"]["type"] == "server_overloaded"
            assert body["error"]["code"] == "server.fd_exhausted"
    lines = hal0d.named("server.fd_exhausted")
    assert len(lines) == 1, lines  # once for the burst, not once per request
    assert (lines[0]["limit"], lines[0]["open"], lines[0]["refused"]) == (LOW_LIMIT, LOW_LIMIT, 1)
    assert lines[0]["where"] == "upstream_connect"

    await exhausted.release()
    await eventually(lambda: len(hal0d.named("server.fd_exhausted")) == 2, REPORT_WINDOW_S + 5,
                "the burst's follow-up line")
    follow_up = hal0d.named("server.fd_exhausted")[1]
    assert (follow_up["refused"], follow_up["refused_total"]) == (2, 3)
    assert "request_id" not in follow_up  # about the burst, not one request

    await eventually(lambda: slots_idle(hal0d.url), SETTLE_S, "every slot idle again")
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{hal0d.url}/v1/chat/completions",
                             json=chat_body("chat")) as response:
            assert response.status == 200
            assert (await response.read()).endswith(b"data: [DONE]\n\n")
        async with http.get(f"{hal0d.url}/metrics") as response:
            metrics = await response.text()
    assert re.search(r"^hal0d_fd_exhausted_total 3\.0$", metrics, re.M), metrics
    assert 'outcome="fd_exhausted"' in metrics
    assert hal0d.process.returncode is None


async def test_a_connection_hal0d_cannot_accept_is_closed_unanswered_without_a_spin(
    exhausted: Holders,
) -> None:
    """With no descriptor left, accept(2) fails: libuv accepts and closes the connection with
    its reserve descriptor, so the client sees it closed with no answer; hal0d burns no CPU on
    the pending connection, keeps listening, and answers once descriptors are free."""
    hal0d = exhausted.hal0d
    await exhausted.fill_to(0)
    pid = hal0d.process.pid
    cpu_before, wall_before = cpu_s(pid), time.monotonic()
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", hal0d.port), timeout=5) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            sock.settimeout(5)
            try:
                answer = sock.recv(4096)
            except ConnectionResetError:
                answer = b""
            assert answer == b"", answer
    # Not a wait for an event: the span over which CPU time is measured. A loop spinning on
    # the unaccepted connection would burn a whole core in it.
    await asyncio.sleep(1.0)
    cpu_used = cpu_s(pid) - cpu_before
    wall = time.monotonic() - wall_before
    assert cpu_used < 0.5 * wall, f"hal0d used {cpu_used:.2f} s of CPU in {wall:.2f} s"

    await exhausted.release()
    await eventually(lambda: open_fds(pid) < LOW_LIMIT - 4, SETTLE_S, "descriptors given back")
    async with aiohttp.ClientSession() as http, http.get(f"{hal0d.url}/healthz") as response:
        assert response.status == 200
    assert hal0d.process.returncode is None


async def test_slot_processes_start_with_the_limit_hal0d_was_started_with(
    launch: Launcher, stub: Stub
) -> None:
    """hal0d raises its own soft limit for its sockets; a slot process gets the soft 1024 back
    (a model server built on select(2) breaks above it, and one that needs more raises its own)."""
    hal0d = await launch(stub, soft=1024, hard=4096, slot=f"""
        [[slots]]
        name = "llm"
        upstream = "http://127.0.0.1:{free_port()}"
        models = ["chat"]
        command = ["sleep", "60"]
    """)
    started = await hal0d.wait_for_event("slot.process_started", timeout=10)
    assert proc_limits(hal0d.process.pid) == (4096, 4096)
    assert proc_limits(started["pid"]) == (1024, 4096)
