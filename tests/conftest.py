"""Shared fixtures: real sockets everywhere. An upstream (the stub, or a purpose-built aiohttp app)
listens on a loopback port; hal0d listens on another, built from a real Config. And one guard over
the whole run: no process a test started may outlive the tests."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import io
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import orjson
import pytest
import structlog
from aiohttp import web
from aiohttp.test_utils import TestServer

from hal0d import logs
from hal0d.app import make_app
from hal0d.config import Config, DispatcherConfig, MetricsConfig, OllamaConfig, SlotConfig
from hal0d.config.ports import unused_port
from hal0d.lifecycle.process import PRCTL
from hal0d.observability.history import HistoryWriter
from hal0d_stub.app import make_stub_app

ROLE_CHUNK = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":null}}]}\n\n'
STUB_MODELS = ("reasoning", "chat", "think-only", "tool", "stall", "chatty", "broken", "shell")


T = TypeVar("T")
POLL_S = 0.02  # how often `eventually` asks: small against every deadline the tests give it


def _last_answer(result: object, failure: AssertionError | None) -> str:
    return f"last check failed: {failure}" if failure is not None else f"last answer: {result!r}"


async def eventually(condition: Callable[[], T] | Callable[[], Awaitable[T]], timeout: float,
                     what: str) -> T:
    """Wait for an event instead of sleeping a fixed time: ask `condition` (a plain or an async
    function) every POLL_S until it returns something truthy, and return that.

    An AssertionError raised by `condition` means "not yet", so a condition can hold the test's
    own asserts and their messages. After `timeout` seconds the test fails with an AssertionError
    naming `what` and the last answer (or the last failed assert). The condition is always asked
    once more after the deadline, so a loop that fell behind cannot fail an event that came.
    """
    deadline = time.monotonic() + timeout
    while True:
        past = time.monotonic() > deadline
        failure: AssertionError | None = None
        result: Any = None
        try:
            result = condition()
            if inspect.isawaitable(result):
                result = await result
        except AssertionError as exc:
            failure = exc
        if _settled(result, failure, past, timeout, what):
            return result  # type: ignore[no-any-return]
        await asyncio.sleep(POLL_S)


def _settled(result: Any, failure: AssertionError | None, past: bool, timeout: float,
             what: str) -> bool:
    """True once the condition held; after the deadline, the failure naming `what`."""
    if failure is None and result:
        return True
    if past:
        raise AssertionError(f"not within {timeout} s: {what}; "
                             f"{_last_answer(result, failure)}") from failure
    return False


def eventually_sync(condition: Callable[[], T], timeout: float, what: str) -> T:
    """`eventually` for tests without an event loop (subprocesses, files, /proc)."""
    deadline = time.monotonic() + timeout
    while True:
        past = time.monotonic() > deadline
        failure: AssertionError | None = None
        result: Any = None
        try:
            result = condition()
        except AssertionError as exc:
            failure = exc
        if _settled(result, failure, past, timeout, what):
            return result  # type: ignore[no-any-return]
        time.sleep(POLL_S)


PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>
LEFTOVERS_KILLED_WITHIN_S = 5.0


def process_state(pid: int) -> tuple[str, int] | None:
    """(state letter, parent pid) from /proc/<pid>/stat; None once the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name in parentheses may hold spaces and ')': the fields resume after the last.
    state, ppid = stat[stat.rindex(")") + 2:].split()[:2]
    return state, int(ppid)


def command_line(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def running(pid: int) -> bool:
    """Whether `pid` still runs. A zombie does not: it is reaped here if it is ours to reap (a
    child of the test process, or an orphan re-parented to it, the subreaper)."""
    state = process_state(pid)
    if state is not None and state[0] == "Z":
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        return False
    return state is not None


def reap_zombie_children() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def live_children(parent: int) -> dict[int, str]:
    """Every running process whose parent is `parent`, with its command line."""
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        pid = int(entry.name) if entry.name.isdigit() else 0
        state = process_state(pid) if pid else None
        if state is not None and state[1] == parent and state[0] != "Z":
            found[pid] = command_line(pid)
    return found


def kill_with_its_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
        os.kill(pid, signal.SIGKILL)


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
    leaked: dict[int, str] = {}
    deadline = time.monotonic() + LEFTOVERS_KILLED_WITHIN_S
    while True:
        reap_zombie_children()
        alive = live_children(os.getpid())
        if not alive or time.monotonic() > deadline:
            break
        leaked.update(alive)
        for pid in alive:
            kill_with_its_group(pid)
        time.sleep(0.05)  # the next round's /proc scan waits for the kills to land
    if leaked or alive:
        named = "\n".join(f"  pid {pid}: {cmd}" for pid, cmd in {**leaked, **alive}.items())
        pytest.fail(f"processes started by the tests outlived them (killed now):\n{named}",
                    pytrace=False)


_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback port nothing listens on (bound, then released), and none this test run has
    handed out before: two calls before either port is bound (hal0d's and its slot's) could
    otherwise get the same one, and the slot's process would find hal0d on its port."""
    while True:
        port = unused_port()
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def read_log(path: Path) -> str:
    return path.read_text() if path.exists() else ""


@dataclasses.dataclass
class Stub:
    server: TestServer
    log: Path

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")

    def lines(self) -> list[str]:
        return read_log(self.log).splitlines()


StubFactory = Callable[..., Awaitable[Stub]]
ServerFactory = Callable[..., Awaitable[TestServer]]


@pytest.fixture
async def start_stub(
    aiohttp_server: Callable[..., Awaitable[TestServer]], tmp_path: Path
) -> StubFactory:
    async def start(delay: float = 0.002, **app_options: Any) -> Stub:
        """`app_options` go to make_stub_app (`props`, `anthropic_native`, ...)."""
        log = tmp_path / f"stub-{free_port()}.log"
        server = await aiohttp_server(make_stub_app(log, delay, **app_options))
        return Stub(server, log)

    return start


@pytest.fixture
async def stub(start_stub: StubFactory) -> Stub:
    return await start_stub()


def make_config(
    upstream: str,
    *,
    tmp_path: Path,
    models: tuple[str, ...] = STUB_MODELS,
    slot: dict[str, Any] | None = None,
    dispatcher: dict[str, Any] | None = None,
    aliases: dict[str, str] | None = None,
    extra_slots: tuple[SlotConfig, ...] = (),
) -> Config:
    """A Config built directly, so tests may use bounds below the TOML minimums."""
    return Config(
        dispatcher=DispatcherConfig(**(dispatcher or {})),
        slots=(SlotConfig(name="llm", upstream=upstream, models=models, **(slot or {})),
               *extra_slots),
        models=aliases or {},
        metrics=MetricsConfig(database=str(tmp_path / "history.sqlite3")),
        base_dir=tmp_path,
    )


@pytest.fixture
async def start_hal0d(
    aiohttp_server: Callable[..., Awaitable[TestServer]], tmp_path: Path
) -> ServerFactory:
    """Start hal0d in front of `upstream`; keyword arguments go to make_config."""

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
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


# upstream_app's: routes ("METHOD /path" to handler) in, the upstream's URL out.
Upstream = Callable[[dict[str, Callable[[web.Request], Awaitable[web.StreamResponse]]]],
                    Awaitable[str]]


@pytest.fixture
async def upstream_app(aiohttp_server: Callable[..., Awaitable[TestServer]]) -> Upstream:
    """A purpose-built upstream: give it {"POST /v1/chat/completions": handler, ...}.
    GET /v1/models answers by default so the health probe sees a live slot."""

    async def start(routes: dict[str, Callable[[web.Request], Awaitable[web.StreamResponse]]]
                    ) -> str:
        app = web.Application()

        async def models(_: web.Request) -> web.Response:
            return web.json_response({"object": "list", "data": []})

        if "GET /v1/models" not in routes:
            app.router.add_get("/v1/models", models)
        for key, handler in routes.items():
            method, path = key.split(" ", 1)
            app.router.add_route(method, path, handler)
        server = await aiohttp_server(app)
        return str(server.make_url("")).rstrip("/")

    return start


def chat_body(model: str = "chat", *, stream: bool = True, content: str = "hi",
              **extra: Any) -> dict[str, Any]:
    return {"model": model, "stream": stream,
            "messages": [{"role": "user", "content": content}], **extra}


async def read_http_chunks(response: aiohttp.ClientResponse) -> list[bytes]:
    """The body as the HTTP chunks it was framed in (chunked transfer encoding boundaries)."""
    chunks: list[bytes] = []
    current = b""
    async for data, end_of_chunk in response.content.iter_chunks():
        current += data
        if end_of_chunk:
            chunks.append(current)
            current = b""
    if current:
        chunks.append(current)
    return chunks


def content_chunk(text: str) -> bytes:
    return (
        b"data: "
        + orjson.dumps(
            {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
        )
        + b"\n\n"
    )


@contextlib.contextmanager
def logs_into_buffer(fmt: str, level: str) -> Iterator[io.StringIO]:
    """hal0d's real logging pipeline (logs.configure, aiohttp's loggers included) into a buffer;
    structlog's configuration and the standard library's logging restored afterwards."""
    # The processors as a list of their own: configure() changes its chain in place.
    saved = {**structlog.get_config(), "processors": list(structlog.get_config()["processors"])}
    root = logging.getLogger()
    saved_root = (root.handlers[:], root.level)
    access = logging.getLogger("aiohttp.access")
    saved_access = access.disabled
    buffer = io.StringIO()
    logs.configure(level=level, fmt=fmt, stream=buffer)
    try:
        yield buffer
    finally:
        structlog.configure(**saved)
        root.handlers[:], _ = saved_root
        root.setLevel(saved_root[1])
        access.disabled = saved_access


OllamaFactory = Callable[..., Awaitable[tuple[TestServer, str]]]


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
