"""A slot's process dies and another program takes its port before the restart: the requests
that were waiting for the slot are never sent to that program. They wait for the restart, or
get 503 with Retry-After, over a real stub process, a real foreign server and real clients."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import socket
import time
from contextlib import AsyncExitStack
from pathlib import Path

import aiohttp
from aiohttp import web

from hal0d.appkeys import LIFECYCLE, SLOTS
from hal0d.config import SlotConfig
from tests.harness.client import CHAT, body, state_is
from tests.harness.config import build_config
from tests.harness.daemons import ServerFactory, start
from tests.harness.poll import eventually
from tests.harness.ports import free_port
from tests.harness.stubs import stub_command

QUEUED = 3


def always(name: str, tmp_path: Path) -> SlotConfig:
    port = free_port()
    return SlotConfig(name=name, upstream=f"http://127.0.0.1:{port}", models=("chat",),
                      command=stub_command(port, tmp_path / f"{name}.log"), max_concurrent=1)


def take_port_when_free(port: int, timeout_s: float = 5.0) -> socket.socket:
    """A listening socket on `port` as soon as the dead process's listener is gone. A blocking
    poll on purpose: hal0d's loop (the test's) must not run meanwhile, so that its child watcher
    has not told the exit yet when the test hands the slot's place on, the instant in which a
    stream's own lease ends with its process's death."""
    deadline = time.monotonic() + timeout_s
    while True:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind(("127.0.0.1", port))
        except OSError:
            listener.close()
            assert time.monotonic() < deadline, f"port {port} still taken"
            time.sleep(0.001)
            continue
        listener.listen(128)
        return listener


async def asked(http: aiohttp.ClientSession, url: str) -> tuple[int, str | None, str]:
    async with http.post(url, json=body("chat")) as resp:
        return resp.status, resp.headers.get("Retry-After"), await resp.text()


async def test_queued_requests_are_never_sent_to_a_program_that_took_a_dead_process_port(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    config = always("a", tmp_path)
    hal0d = await start(start_hal0d, build_config(tmp_path, dataclasses.replace(
        config, queue_timeout_s=20.0)))
    await state_is(http, hal0d, "a", "ready")
    slot, runner = hal0d.app[SLOTS]["a"], hal0d.app[LIFECYCLE].runners["a"]
    hits: list[str] = []

    async def foreign(request: web.Request) -> web.Response:
        hits.append(f"{request.method} {request.path}")
        return web.json_response({"id": "not-the-slot", "choices": []})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", foreign)
    other = web.AppRunner(app)
    await other.setup()
    try:
        async with AsyncExitStack() as held:
            await held.enter_async_context(slot.lease())  # the one place, as a stream holds it
            queued = [asyncio.create_task(asked(http, str(hal0d.make_url(CHAT))))
                      for _ in range(QUEUED)]
            await eventually(lambda: slot.queued == QUEUED, 5, "the requests queued")
            assert runner.child is not None
            os.kill(runner.child.pid, signal.SIGKILL)
            listener = take_port_when_free(int(config.upstream.rsplit(":", 1)[1]))
        # The place went to the first queued request in the same step, the exit not yet told.
        assert slot.in_flight == 1 and slot.state.value == "serving", slot
        await web.SockSite(other, listener).start()
        answers = await asyncio.gather(*queued)
    finally:
        await other.cleanup()
    assert hits == [], f"sent to the program on the slot's port: {hits}"
    for status, retry_after, text in answers:
        assert status in (200, 503), text
        if status == 503:
            assert retry_after is not None and int(retry_after) >= 1, text
