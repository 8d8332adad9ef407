"""A failed upstream is named to a model client by its slot and its cause, never by its address:
every surface, streamed or not, for an upstream that refuses connections, one that breaks off
its answer, and one that drops the request once a keepalive has sent the stream's head (the
error is then the stream's last frame). The address is the operator's: the log line
`upstream.unavailable` names it. Over real sockets, the bodies read raw, as a client gets them;
then the words of the transport errors a socket test cannot make at will, and of a slot's
reason, which may hold its process's last lines."""

from __future__ import annotations

import asyncio
import errno
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy
from structlog.testing import capture_logs
from yarl import URL

from hal0d.config import SlotConfig
from hal0d.errors import UpstreamUnavailable
from hal0d.transport.failures import transport_reason, upstream_errors
from tests.harness.daemons import OllamaFactory
from tests.harness.ports import free_port
from tests.harness.stubs import StubFactory, Upstream

HI = [{"role": "user", "content": "hi"}]

# (the Ollama listener's, path, body but model and stream, whether it streams, the slot's options)
SURFACES: dict[str, tuple[bool, str, dict[str, Any], bool, dict[str, Any]]] = {
    "chat": (False, "/v1/chat/completions", {"messages": HI}, True, {}),
    "completions": (False, "/v1/completions", {"prompt": "hi"}, True, {}),
    "embeddings": (False, "/v1/embeddings", {"input": "hi"}, False, {}),
    "responses": (False, "/v1/responses", {"input": "hi"}, True, {}),
    "anthropic": (False, "/v1/messages", {"max_tokens": 16, "messages": HI}, True,
                  {"anthropic": "translate"}),
    "anthropic native": (False, "/v1/messages", {"max_tokens": 16, "messages": HI}, True,
                         {"anthropic": "native"}),
    "ollama chat": (True, "/api/chat", {"messages": HI}, True, {}),
    "ollama generate": (True, "/api/generate", {"prompt": "hi"}, True, {}),
    "ollama embed": (True, "/api/embed", {"input": "hi"}, False, {}),
}
WHOLE = [pytest.param(name, False, id=name) for name in SURFACES]
EVERY = WHOLE + [pytest.param(name, True, id=f"{name}, streamed")
                 for name, (*_, streams, _options) in SURFACES.items() if streams]
STREAMED = [param for param in EVERY if param.values[1]]


async def ask(start_ollama: OllamaFactory, upstream: str, surface: str, stream: bool,
              model: str, **dispatcher: float) -> tuple[str, list[dict[str, Any]]]:
    """The surface's answer to a request for `model` through hal0d in front of `upstream`, as
    the raw text a client reads, and the log lines of it."""
    ollama, path, body, _, options = SURFACES[surface]
    hal0d, ollama_base = await start_ollama(upstream, slot=options, dispatcher=dispatcher)
    base = ollama_base if ollama else str(hal0d.make_url("")).rstrip("/")
    sent = {**body, "model": model, "stream": stream}
    with capture_logs() as logs:
        async with aiohttp.ClientSession() as http, http.post(base + path, json=sent) as resp:
            text = await resp.text()
    return text, logs


def assert_named_without_address(text: str, logs: list[dict[str, Any]], upstream: str,
                                 cause: str) -> None:
    """The slot and the cause in what the client read, no trace of the upstream's address; the
    log line names the address."""
    port = urlsplit(upstream).port  # as a URL names it, and as an OS error does: ('host', port)
    assert "127.0.0.1" not in text and "http://" not in text, text
    assert f":{port}" not in text and f", {port})" not in text, text
    assert "'llm'" in text and cause in text, text
    logged = [entry for entry in logs if entry["event"] == "upstream.unavailable"]
    assert logged and all(entry["upstream"] == upstream for entry in logged), logs


@pytest.mark.parametrize(("surface", "stream"), EVERY)
async def test_a_refused_connect_names_the_slot_and_the_cause_but_not_the_address(
    surface: str, stream: bool, start_ollama: OllamaFactory
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    text, logs = await ask(start_ollama, dead, surface, stream, "chat")
    assert_named_without_address(text, logs, dead, "cannot connect (connection refused)")


@pytest.mark.parametrize(("surface", "stream"), WHOLE)
async def test_an_answer_broken_off_names_the_slot_and_the_cause_but_not_the_address(
    surface: str, stream: bool, start_ollama: OllamaFactory, start_stub: StubFactory
) -> None:
    """The stub's `broken` model sends the head and half the body, then cuts the connection."""
    stub = await start_stub(anthropic_native=True)  # the slot's options say which it takes
    text, logs = await ask(start_ollama, stub.url, surface, stream, "broken")
    assert_named_without_address(text, logs, stub.url, "incomplete body")


@pytest.mark.parametrize(("surface", "stream"), STREAMED)
async def test_a_drop_after_the_head_ends_the_stream_naming_the_slot_but_not_the_address(
    surface: str, stream: bool, start_ollama: OllamaFactory, upstream_app: Upstream
) -> None:
    """The upstream takes the request and drops it while keepalives go out: the surface's last
    frame carries the error."""

    async def drops(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(0.3)
        assert request.transport is not None
        request.transport.abort()
        return web.Response()

    upstream = await upstream_app({f"POST /v1/{path}": drops for path in (
        "chat/completions", "completions", "responses", "messages")})
    text, logs = await ask(start_ollama, upstream, surface, stream, "chat", keepalive_s=0.05)
    assert text.startswith((":", "event: ", "{")), text  # the head and a keepalive went first
    assert_named_without_address(text, logs, upstream, "connection closed")


SLOT = SlotConfig(name="llm", upstream="http://127.0.0.1:9", models=("chat",))
URL_OF = URL(SLOT.upstream + "/v1/chat/completions")
HEAD_OF = aiohttp.RequestInfo(URL_OF, "POST", CIMultiDictProxy(CIMultiDict()), URL_OF)


@pytest.mark.parametrize(("error", "words"), [
    # aiohttp's own text names the URL ("Can not write request body for http://...").
    (aiohttp.ClientOSError(errno.ECONNRESET, f"Can not write request body for {URL_OF}"),
     "connection reset by peer reading"),
    (aiohttp.ClientResponseError(HEAD_OF, (), status=400, message="Bad status line"),
     "invalid answer reading"),
    (aiohttp.ServerDisconnectedError(), "connection closed reading"),
    (aiohttp.ClientPayloadError("Response payload is not completed"), "incomplete body reading"),
    (aiohttp.InvalidURL(URL_OF), "invalid upstream URL"),
])
def test_a_transport_error_is_worded_from_its_type_and_errno_never_its_text(
    error: Exception, words: str
) -> None:
    assert transport_reason(error, "reading") == words


def test_a_slots_reason_reaches_the_client_without_the_upstreams_address() -> None:
    """A slot's reason may be its process's last lines, which name where it listens."""
    said = ("process exited with code 1: listening on http://127.0.0.1:9 | 127.0.0.1:9 taken | "
            "couldn't bind HTTP server socket, hostname: 127.0.0.1, port: 9")
    with pytest.raises(UpstreamUnavailable) as caught, upstream_errors(
            SLOT, "reading", slot_reason=said):
        raise TimeoutError
    assert caught.value.message == (
        "slot 'llm' is unavailable: timed out reading; the slot is in error: process exited "
        "with code 1: listening on [upstream] | [upstream] taken | couldn't bind HTTP server "
        "socket, [upstream]")
