"""Safe on a box with a browser: a request whose Host is not hal0d's (a DNS-rebinding page) or
whose Origin is a foreign web page is refused with 403 in its surface's envelope before anything
reaches an upstream (the stub's request log shows nothing); loopback hosts, no Origin (curl, the
SDKs) and hal0d's own origin are served; allowed_hosts and allowed_origins let others in, and
only an allowed origin gets CORS answers. Real sockets."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp.test_utils import TestServer
from structlog.testing import capture_logs

from hal0d.config import ServerConfig
from tests.harness.client import chat_body
from tests.harness.config import make_config
from tests.harness.daemons import ServerFactory
from tests.harness.stubs import Stub

ATTACKER = "http://attacker.test"
TEXT_PLAIN = {"Content-Type": "text/plain"}  # what a page may send without a preflight
CHAT = ("POST", "/v1/chat/completions", chat_body("chat", stream=False))
MESSAGES = ("POST", "/llm/v1/messages",
            {"model": "chat", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})
RESPONSES = ("POST", "/v1/responses", {"model": "chat", "input": "hi"})
UNLOAD = ("POST", "/api/slots/llm/unload", None)
READS = [("GET", "/api/requests", None), ("GET", "/api/slots", None)]


async def start(start_hal0d: ServerFactory, stub: Stub, tmp_path: Path,
                **server: Any) -> TestServer:
    config = make_config(stub.url, tmp_path=tmp_path)
    config = dataclasses.replace(config, server=ServerConfig(**server))
    return await start_hal0d(stub.url, config=config)


Call = tuple[str, str, Any]  # method, path, JSON body (None: none)


async def call(http: aiohttp.ClientSession, hal0d: TestServer, what: Call,
               headers: dict[str, str]) -> tuple[int, Any, Any]:
    method, path, body = what
    data = None if body is None else orjson.dumps(body)
    async with http.request(method, hal0d.make_url(path), data=data, headers=headers) as resp:
        content = await resp.json() if resp.content_type == "application/json" else None
        return resp.status, content, resp.headers


def own(hal0d: TestServer, name: str = "127.0.0.1") -> str:
    return f"{name}:{hal0d.port}"


async def test_a_foreign_host_or_origin_is_403_in_each_surfaces_envelope_and_reaches_nothing(
    start_hal0d: ServerFactory, stub: Stub, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    hal0d = await start(start_hal0d, stub, tmp_path)
    before = stub.lines()
    rebinding = {"Host": "attacker.test", "Origin": ATTACKER, **TEXT_PLAIN}
    with capture_logs() as logs:
        for what in (CHAT, MESSAGES, RESPONSES, UNLOAD, *READS):
            path = what[1]
            status, answer, headers = await call(http, hal0d, what, rebinding)
            assert status == 403, (path, answer)
            assert hdrs_cors(headers) == {}, (path, headers)
            if path.startswith("/llm/"):
                assert answer["type"] == "error"
                assert answer["error"]["type"] == "permission_error", answer
            else:
                assert answer["error"]["type"] == "permission_error", answer
                assert answer["error"]["code"] == "access.forbidden", answer
            assert "attacker.test" in str(answer)
        # The rebinding page's reads, with no Origin at all (a same-origin GET).
        for what in READS:
            status, _, _ = await call(http, hal0d, what, {"Host": "attacker.test"})
            assert status == 403, what
        # A foreign page with the right Host (a plain cross-site request): its Origin is refused,
        # on every method, the event feed included.
        for what in (CHAT, UNLOAD, ("GET", "/api/events", None)):
            status, answer, _ = await call(http, hal0d, what,
                                           {"Host": own(hal0d), "Origin": ATTACKER, **TEXT_PLAIN})
            assert status == 403 and "attacker.test" in str(answer), (what, answer)
    assert stub.lines() == before  # nothing reached the upstream
    refused = [entry for entry in logs if entry["event"] == "server.host_refused"]
    assert [entry["host"] for entry in refused] == ["attacker.test"]  # once a minute a host


async def test_loopback_hosts_no_origin_and_hal0ds_own_origin_are_served(
    start_hal0d: ServerFactory, stub: Stub, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    hal0d = await start(start_hal0d, stub, tmp_path)
    for host in (own(hal0d), own(hal0d, "localhost"), "127.0.0.1", "localhost",
                 f"[::1]:{hal0d.port}"):
        for what in (CHAT, *READS):
            status, answer, _ = await call(http, hal0d, what, {"Host": host})
            assert status == 200, (host, what, answer)
    for name in ("127.0.0.1", "localhost"):
        same = {"Host": own(hal0d, name), "Origin": f"http://{own(hal0d, name)}"}
        for what in (CHAT, MESSAGES, *READS):
            status, answer, headers = await call(http, hal0d, what, same)
            assert status == 200, (name, what, answer)
            assert hdrs_cors(headers) == {}  # same origin: no CORS needed, none given
    assert stub.lines()  # they reached the upstream


async def test_allowed_hosts_and_origins_are_let_in_and_only_an_allowed_origin_gets_cors(
    start_hal0d: ServerFactory, stub: Stub, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    webui = "http://webui.lan:3000"
    hal0d = await start(start_hal0d, stub, tmp_path, allowed_hosts=("box.lan",),
                        allowed_origins=(webui,))
    status, answer, _ = await call(http, hal0d, CHAT, {"Host": f"box.lan:{hal0d.port}"})
    assert status == 200, answer
    status, answer, headers = await call(http, hal0d, CHAT,
                                         {"Host": own(hal0d), "Origin": webui})
    assert status == 200, answer
    assert headers["Access-Control-Allow-Origin"] == webui
    assert "X-Request-Id" in headers["Access-Control-Expose-Headers"]
    asked = {"Host": own(hal0d), "Origin": webui, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}
    status, _, headers = await call(http, hal0d, ("OPTIONS", "/v1/chat/completions", None), asked)
    assert status == 204
    assert headers["Access-Control-Allow-Origin"] == webui
    assert "POST" in headers["Access-Control-Allow-Methods"]
    assert headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    status, _, headers = await call(http, hal0d, ("OPTIONS", "/v1/chat/completions", None),
                                    {**asked, "Origin": ATTACKER})
    assert status == 403 and hdrs_cors(headers) == {}
    before = stub.lines()
    status, _, _ = await call(http, hal0d, CHAT, {"Host": "other.lan"})
    assert status == 403 and stub.lines() == before


@pytest.mark.parametrize(("listening", "host", "allowed"), [
    ("0.0.0.0", "192.168.1.5:8080", True),  # an IP literal cannot be rebound
    ("0.0.0.0", "evil.example:8080", False),
    ("192.168.1.5", "192.168.1.5", True),
    ("192.168.1.5", "192.168.1.6", False),
    ("127.0.0.1", "app.localhost:8080", True),
    ("127.0.0.1", "LOCALHOST", True),
])
def test_the_address_hal0d_listens_on_is_its_own_host(listening: str, host: str,
                                                      allowed: bool) -> None:
    from hal0d.front.access import host_allowed

    assert host_allowed(host, ServerConfig(host=listening)) is allowed


def hdrs_cors(headers: Any) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower().startswith("access-control-")}
