"""The fixtures: real sockets everywhere. An upstream (the stub, or a purpose-built aiohttp app)
listens on a loopback port; hal0d listens on another, built from a real Config in the test's
event loop, or runs as a real `hal0d serve` process. And one guard over the whole run: no
process a test started may outlive the tests. What the fixtures are built from is in
tests/harness/."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from hal0d.app import make_app
from hal0d.config import OllamaConfig
from hal0d.lifecycle.process import PRCTL
from hal0d.observability.history import HistoryWriter
from tests.harness.config import make_config
from tests.harness.daemons import (
    Hal0dProcess,
    Hal0dProcessFactory,
    OllamaFactory,
    ServerFactory,
    launch,
    stop,
)
from tests.harness.logs import watching_for_bugs
from tests.harness.page import open_browser
from tests.harness.ports import free_port
from tests.harness.processes import kill_leftover_children, stub_pids
from tests.harness.stubs import (
    Handler,
    ServerStarter,
    Stub,
    StubFactory,
    Upstream,
    serve_stub,
    serve_upstream,
)

PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>
LEFTOVERS_KILLED_WITHIN_S = 5.0


@pytest.fixture(scope="session", autouse=True)
def no_process_outlives_the_tests() -> Iterator[None]:
    """Fails the run when a process started by a test still runs after the last test.

    The test process becomes a child subreaper: whatever a test started and lost track of (a slot
    process whose hal0d died, the grandchild of a shell) is re-parented to it instead of to init,
    so at the end every leftover is a child of ours, found in /proc. Leftovers are killed (their
    process groups too, then again for whatever they orphaned), and the session fails naming them;
    an error in a session fixture's teardown makes pytest's exit code non-zero.
    """
    if PRCTL is None or PRCTL(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        yield  # no subreaper on this platform: leftovers would go to init, out of our sight
        return
    yield
    if leaked := kill_leftover_children(LEFTOVERS_KILLED_WITHIN_S):
        named = "\n".join(f"  pid {pid}: {cmd}" for pid, cmd in leaked.items())
        pytest.fail(f"processes started by the tests outlived them (killed now):\n{named}",
                    pytrace=False)


@pytest.fixture(autouse=True)
def hal0d_logged_no_bug() -> Iterator[None]:
    """Fails a test whose hal0d logged a line only a bug of hal0d's writes (logs.BUG_EVENTS:
    `lifecycle.task_failed`, a task of the lifecycle manager raised), naming each line.

    In process, structlog tells the watch of each event before any processor runs, so a test's
    own capture_logs or log level hides none; the log of every `hal0d serve` the harness
    started, and hal0d's pipeline into a logs_into_buffer buffer, are read after the test. An
    autouse fixture is set up before the test's own fixtures and torn down after them: what a
    daemon logs while it stops counts too.
    """
    with watching_for_bugs() as watch:
        yield
    if found := watch.found():
        pytest.fail("hal0d logged what only a bug of its own writes:\n" + "\n".join(found),
                    pytrace=False)


@pytest.fixture
async def start_stub(aiohttp_server: ServerStarter, tmp_path: Path) -> StubFactory:
    """The stub in the test's event loop: `delay` and make_stub_app's options (`props`,
    `anthropic_native`, ...)."""

    async def start(delay: float = 0.002, **app_options: Any) -> Stub:
        return await serve_stub(aiohttp_server, tmp_path, delay, **app_options)

    return start


@pytest.fixture
async def stub(start_stub: StubFactory) -> Stub:
    return await start_stub()


@pytest.fixture
async def start_hal0d(aiohttp_server: ServerStarter, tmp_path: Path) -> ServerFactory:
    """Start hal0d in process in front of `upstream`; keyword arguments go to make_config (or
    `config=` is the whole config)."""

    started = 0

    async def start(upstream: str, **options: Any) -> TestServer:
        nonlocal started
        config = options.pop("config", None) or make_config(upstream, tmp_path=tmp_path, **options)
        started += 1
        if started > 1 and config.database_path() == tmp_path / "history.sqlite3":
            # A second hal0d in one test keeps a history of its own, as two daemons must.
            config = dataclasses.replace(config, metrics=dataclasses.replace(
                config.metrics, database=str(tmp_path / f"history-{started}.sqlite3")))
        return await aiohttp_server(make_app(config))

    return start


@pytest.fixture
async def hal0d(stub: Stub, start_hal0d: ServerFactory) -> TestServer:
    """hal0d in process in front of the stub, `claude-*` an alias of its `reasoning` model: the
    Anthropic surface's tests ask it as a Claude client does. A test module's own `hal0d`
    fixture takes this one's place in that module."""
    return await start_hal0d(stub.url, aliases={"claude-*": "reasoning"})


@pytest.fixture
async def start_hal0d_process(tmp_path: Path) -> AsyncIterator[Hal0dProcessFactory]:
    """Start a real `hal0d serve` in front of `upstream`; keyword arguments go to config_text
    (`slot=`: its slots instead). Each is stopped after the test, and none of the slot
    processes they started may outlive them."""
    started: list[Hal0dProcess] = []

    async def start(upstream: str = "unused", **options: Any) -> Hal0dProcess:
        hal0d = await launch(tmp_path, upstream, **options)
        started.append(hal0d)
        return hal0d

    yield start
    for hal0d in started:
        await stop(hal0d.process)
    assert not stub_pids(str(tmp_path)), "a slot process outlived hal0d"


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


@pytest.fixture
async def upstream_app(aiohttp_server: ServerStarter) -> Upstream:
    """A purpose-built upstream: give it {"POST /v1/chat/completions": handler, ...}.
    GET /v1/models answers by default so the health probe sees a live slot."""

    async def start(routes: dict[str, Handler]) -> str:
        return await serve_upstream(aiohttp_server, routes)

    return start


@pytest.fixture
async def start_ollama(start_hal0d: ServerFactory, tmp_path: Path) -> OllamaFactory:
    """Start hal0d in front of `upstream` with its Ollama listener on a port of its own, served
    as `hal0d serve` serves it: a second site of the same application's runner. Returns the
    server and the Ollama listener's base URL; keyword arguments go to make_config (or
    `config=`, whose [ollama] listen is set here)."""

    async def start(upstream: str, **options: Any) -> tuple[TestServer, str]:
        config = options.pop("config", None) or make_config(upstream, tmp_path=tmp_path,
                                                            **options)
        port = free_port()
        config = dataclasses.replace(config, ollama=OllamaConfig(listen=f"127.0.0.1:{port}"))
        server = await start_hal0d(upstream, config=config)
        assert server.runner is not None
        site = web.TCPSite(server.runner, "127.0.0.1", port)
        await site.start()
        return server, f"http://127.0.0.1:{port}"

    return start


@pytest.fixture
async def writer(tmp_path: Path) -> AsyncIterator[HistoryWriter]:
    """A started history writer on a fresh database, closed after the test."""
    w = HistoryWriter(tmp_path / "history.db")
    await w.start()
    yield w
    await w.close()


@pytest.fixture
async def silent_socket() -> AsyncIterator[str]:
    """An upstream that accepts connections and never answers a byte."""
    held: list[asyncio.StreamWriter] = []

    async def accept(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    for writer in held:
        writer.close()
    server.close()
    await server.wait_closed()


@pytest.fixture
def browser() -> Iterator[Any]:
    """Headless chromium (the status page's tests skip where there is none)."""
    with open_browser() as driver:
        yield driver
