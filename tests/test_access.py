"""Access control over real sockets: keys on every /v1, /llm and /api route, the two envelopes of a
refusal, the open health check, the keys file, and a client key that goes nowhere (no upstream,
no log line)."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import re
from contextlib import AbstractContextManager

import aiohttp
import orjson
import pytest
from aiohttp import hdrs, web
from aiohttp.test_utils import TestServer
from structlog.testing import capture_logs

from hal0d.app import make_app, warn_if_exposed
from hal0d.config import ServerConfig, load, parse
from hal0d.handlers import openai
from tests.harness.client import chat_body
from tests.harness.config import KEY, OTHER_KEY, WRONG_KEY, keyed_config, make_config
from tests.harness.logs import logs_into_buffer
from tests.harness.poll import eventually
from tests.harness.stubs import recording_upstream

SLOT_KEY = "slot-upstream-key-Mn3"
PROTECTED = ("/v1/", "/llm/", "/api/")


def concrete_routes(app: web.Application) -> list[tuple[str, str]]:
    """(method, path) of every route the app serves; the OpenAI endpoint pattern expanded."""
    routes = []
    for route in app.router.routes():
        if route.method == hdrs.METH_HEAD:
            continue
        info = route.resource.get_info() if route.resource else {}
        if "path" in info:
            routes.append((route.method, info["path"]))
        else:
            formatter, pattern = info["formatter"], info["pattern"]
            # {endpoint}: each OpenAI endpoint; {name}: the test's slot (the admin slot routes);
            # {id}: a Responses API answer's id.
            expanded = {formatter.replace("{endpoint}", endpoint).replace("{name}", "llm")
                        .replace("{id}", "resp_1") for endpoint in openai.ENDPOINTS}
            matching = [path for path in expanded if pattern.fullmatch(path)]
            assert len(matching) == 1, (formatter, pattern)
            routes.append((route.method, matching[0]))
    return routes


def is_anthropic(path: str) -> bool:
    return path.startswith(("/llm/v1/messages", "/v1/messages"))


def assert_401_envelope(path: str, status: int, raw: bytes) -> None:
    assert status == 401, (path, status, raw[:200])
    body = orjson.loads(raw)
    if is_anthropic(path):
        assert body["type"] == "error" and set(body) == {"type", "error"}, (path, body)
        assert body["error"]["type"] == "authentication_error", (path, body)
        assert body["error"]["message"], (path, body)
    else:
        assert set(body) == {"error"}, (path, body)
        assert body["error"]["type"] == "authentication_error", (path, body)
        assert body["error"]["code"] == "auth.invalid_key", (path, body)
        assert body["error"]["message"], (path, body)


REFUSED_HEADERS: dict[str, dict[str, str]] = {
    "no key": {},
    "wrong bearer": {"Authorization": f"Bearer {WRONG_KEY}"},
    "wrong x-api-key": {"x-api-key": WRONG_KEY},
    "key with another scheme": {"Authorization": f"Basic {KEY}"},
    "bare key in authorization": {"Authorization": KEY},
    "empty bearer": {"Authorization": "Bearer "},
    "prefix of the key": {"Authorization": f"Bearer {KEY[:-1]}"},
    "key with a suffix": {"x-api-key": KEY + "x"},
    "wrong bearer beside a wrong x-api-key": {"Authorization": f"Bearer {WRONG_KEY}",
                                             "x-api-key": "nope"},
}
ACCEPTED_HEADERS: dict[str, dict[str, str]] = {
    "bearer": {"Authorization": f"Bearer {KEY}"},
    "lower-case bearer": {"Authorization": f"bearer {KEY}"},
    "x-api-key": {"x-api-key": KEY},
    "second key as x-api-key": {"x-api-key": OTHER_KEY},
    "second key as bearer": {"Authorization": f"Bearer {OTHER_KEY}"},
}


async def test_every_v1_llm_and_api_route_refuses_a_missing_or_wrong_key_and_accepts_a_right_one(
    stub, start_hal0d, http, tmp_path
):
    config = keyed_config(stub.url, tmp_path)
    hal0d = await start_hal0d(stub.url, config=config)
    routes = [r for r in concrete_routes(make_app(config)) if r[1].startswith(PROTECTED)]
    # Read from the router: a route added later is covered without editing this test.
    assert len(routes) >= 2 * (1 + len(openai.ENDPOINTS)) + 4 + 3, routes
    refused = accepted = 0
    for method, path in routes:
        for headers in REFUSED_HEADERS.values():
            async with http.request(method, hal0d.make_url(path), data=b"{}",
                                    headers=headers) as resp:
                raw = await resp.read()
            assert_401_envelope(path, resp.status, raw)
            assert "Traceback" not in raw.decode(), raw
            refused += 1
        for name, headers in ACCEPTED_HEADERS.items():
            async with http.request(method, hal0d.make_url(path), data=b"{}",
                                    headers=headers) as resp:
                # The event feed never ends: its status line is the answer.
                raw = b"" if path == "/api/events" else await resp.read()
            # {} is a bad body for the POST routes (400): what matters is that it got past auth.
            assert resp.status != 401 and resp.status < 500, (method, path, name, resp.status, raw)
            accepted += 1
    print(f"access: {len(routes)} protected routes, {refused} refused attempts all 401, "
          f"{accepted} keyed attempts all let in, failures: 0")


async def test_a_refusal_is_the_openai_envelope_on_v1_and_the_anthropic_envelope_on_messages(
    stub, start_hal0d, http, tmp_path
):
    hal0d = await start_hal0d(stub.url, config=keyed_config(stub.url, tmp_path))
    answers = {}
    for path, body in (("/v1/chat/completions", chat_body(stream=False)),
                       ("/llm/v1/chat/completions", chat_body(stream=True)),
                       ("/llm/v1/messages", {"model": "chat", "max_tokens": 8, "stream": True,
                                             "messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/messages", {"model": "chat", "max_tokens": 8,
                                         "messages": [{"role": "user", "content": "hi"}]})):
        async with http.post(hal0d.make_url(path), json=body,
                             headers={"x-api-key": WRONG_KEY}) as resp:
            answers[path] = orjson.loads(await resp.read())
            assert resp.status == 401
            assert resp.headers[hdrs.CONTENT_TYPE].startswith("application/json")
    assert answers["/v1/chat/completions"]["error"]["type"] == "authentication_error"
    assert answers["/llm/v1/chat/completions"]["error"]["code"] == "auth.invalid_key"
    for path in ("/llm/v1/messages", "/v1/messages"):
        assert answers[path]["type"] == "error"
        assert answers[path]["error"]["type"] == "authentication_error"
    # Nothing was dispatched: the stub never saw a request.
    assert not any("start" in line for line in stub.lines()), stub.lines()


@pytest.mark.parametrize("protect_metrics", [False, True])
async def test_healthz_is_always_open_and_metrics_is_open_unless_protect_metrics(
    protect_metrics, stub, start_hal0d, http, tmp_path
):
    hal0d = await start_hal0d(
        stub.url, config=keyed_config(stub.url, tmp_path, protect_metrics=protect_metrics)
    )
    async with http.get(hal0d.make_url("/healthz")) as resp:
        assert resp.status == 200
        assert (await resp.json())["status"] == "ok"
    async with http.get(hal0d.make_url("/metrics")) as resp:
        raw = await resp.read()
        if protect_metrics:
            assert_401_envelope("/metrics", resp.status, raw)
        else:
            assert resp.status == 200 and b"# TYPE" in raw
    async with http.get(hal0d.make_url("/metrics"), headers={"x-api-key": KEY}) as resp:
        assert resp.status == 200 and b"# TYPE" in await resp.read()


async def test_api_keys_file_named_in_the_toml_is_loaded_and_its_keys_let_requests_in(
    stub, start_hal0d, http, tmp_path
):
    keys_file = tmp_path / "hal0d-keys"
    keys_file.write_text(f"# one key per line\n{KEY}\n\n  {OTHER_KEY}  \n")
    toml = tmp_path / "hal0d.toml"
    toml.write_text(
        f'[server]\napi_keys_file = "hal0d-keys"\n\n'
        f'[metrics]\ndatabase = "{tmp_path / "history.sqlite3"}"\n\n'
        f'[[slots]]\nname = "llm"\nupstream = "{stub.url}"\nmodels = ["chat"]\n'
    )
    config = load(toml)
    assert config.server.accepted_keys == {KEY, OTHER_KEY}
    assert "# one key per line" not in config.server.accepted_keys
    hal0d = await start_hal0d(stub.url, config=config)
    body = chat_body(stream=False)
    async with http.post(hal0d.make_url("/v1/chat/completions"), json=body) as resp:
        assert_401_envelope("/v1/chat/completions", resp.status, await resp.read())
    for headers in ({"Authorization": f"Bearer {KEY}"}, {"x-api-key": OTHER_KEY}):
        async with http.post(hal0d.make_url("/v1/chat/completions"), json=body,
                             headers=headers) as resp:
            assert resp.status == 200, await resp.read()
    async with http.post(hal0d.make_url("/v1/chat/completions"), json=body,
                         headers={"x-api-key": "# one key per line"}) as resp:
        assert resp.status == 401


def test_api_keys_from_a_dict_and_from_a_file_are_both_accepted(tmp_path):
    (tmp_path / "keys").write_text(f"{OTHER_KEY}\n")
    config = parse({"server": {"api_keys": [KEY], "api_keys_file": "keys"}}, base_dir=tmp_path)
    assert config.server.accepted_keys == {KEY, OTHER_KEY}


async def test_the_client_key_is_never_forwarded_upstream_while_the_slot_key_is_injected(
    upstream_app, start_hal0d, http, tmp_path
):
    seen: list[tuple[str, dict[str, str]]] = []
    url = await upstream_app(recording_upstream(seen))
    hal0d = await start_hal0d(url, config=keyed_config(url, tmp_path, slot_key=SLOT_KEY))
    anthropic = {"model": "chat", "max_tokens": 8,
                 "messages": [{"role": "user", "content": "hi"}]}
    both = {"Authorization": f"Bearer {KEY}", "x-api-key": KEY}
    calls = [
        ("/v1/chat/completions", chat_body(stream=False), {"Authorization": f"Bearer {KEY}"}),
        ("/llm/v1/chat/completions", chat_body(stream=True), {"x-api-key": KEY}),
        ("/v1/chat/completions", chat_body(stream=True), both),
        ("/llm/v1/messages", anthropic, {"x-api-key": KEY}),
        ("/v1/messages", {**anthropic, "stream": True}, both),
        ("/llm/v1/messages/count_tokens", anthropic, {"Authorization": f"Bearer {KEY}"}),
    ]
    for path, body, headers in calls:
        async with http.post(hal0d.make_url(path), json=body, headers=headers) as resp:
            raw = await resp.read()
            assert resp.status == 200, (path, raw)
    dispatched = [(what, headers) for what, headers in seen if what != "GET /v1/models"]
    assert len(dispatched) >= len(calls), seen
    for what, headers in seen:
        lowered = {k.lower(): v for k, v in headers.items()}
        assert KEY not in str(headers), (what, headers)
        assert "x-api-key" not in lowered, (what, headers)
        assert lowered.get("authorization") == f"Bearer {SLOT_KEY}", (what, headers)


async def test_without_a_slot_key_the_upstream_gets_no_authorization_at_all(
    upstream_app, start_hal0d, http, tmp_path
):
    seen: list[tuple[str, dict[str, str]]] = []
    url = await upstream_app(recording_upstream(seen))
    hal0d = await start_hal0d(url, config=keyed_config(url, tmp_path))
    async with http.post(hal0d.make_url("/v1/chat/completions"), json=chat_body(stream=False),
                         headers={"Authorization": f"Bearer {KEY}", "x-api-key": KEY}) as resp:
        assert resp.status == 200
    assert seen
    for what, headers in seen:
        lowered = {k.lower() for k in headers}
        assert not lowered & {"authorization", "x-api-key"}, (what, headers)


def rendered_logs() -> AbstractContextManager[io.StringIO]:
    """hal0d's real logging pipeline (debug level, aiohttp's loggers included) into a buffer."""
    return logs_into_buffer("json", "debug")


async def exercise_with_keys(http: aiohttp.ClientSession, hal0d: TestServer) -> int:
    """Requests that succeed, fail auth, fail validation, stream, break: every kind of log line."""
    anthropic = {"model": "chat", "max_tokens": 8, "stream": True,
                 "messages": [{"role": "user", "content": "hi"}]}
    calls = [
        ("/v1/chat/completions", chat_body(stream=False), {"Authorization": f"Bearer {KEY}"}),
        ("/v1/chat/completions", chat_body("reasoning"), {"x-api-key": KEY}),
        ("/v1/chat/completions", chat_body("broken"), {"x-api-key": KEY}),
        ("/llm/v1/messages", anthropic, {"x-api-key": KEY}),
        ("/llm/v1/messages", {**anthropic, "model": "broken"}, {"Authorization": f"Bearer {KEY}"}),
        ("/v1/chat/completions", {"model": 5}, {"x-api-key": KEY}),
        ("/v1/chat/completions", chat_body("no-such-model"), {"x-api-key": KEY}),
        ("/v1/chat/completions", chat_body(), {"x-api-key": WRONG_KEY}),
        ("/llm/v1/messages", anthropic, {"Authorization": f"Bearer {WRONG_KEY}"}),
        ("/api/slots", None, {"x-api-key": WRONG_KEY}),
        ("/api/requests", None, {"x-api-key": KEY}),
    ]
    for path, body, headers in calls:
        method = "GET" if body is None else "POST"
        async with http.request(method, hal0d.make_url(path), json=body,
                                headers={**headers, "X-Request-Id": "leak-check"}) as resp:
            await resp.read()
    return len(calls)


async def test_neither_the_client_key_nor_a_wrong_key_appears_in_any_log_event(
    stub, start_hal0d, http, tmp_path
):
    hal0d = await start_hal0d(stub.url, config=keyed_config(stub.url, tmp_path,
                                                            slot_key=SLOT_KEY))
    with capture_logs() as events:
        calls = await exercise_with_keys(http, hal0d)
        await eventually(
            lambda: len([e for e in events if e["event"] == "request.done"]) >= calls, 2.0,
            "every request's request.done line",
        )
    assert len([e for e in events if e["event"] == "request.done"]) == calls, events
    for event in events:
        text = str(event)
        for secret in (KEY, WRONG_KEY, SLOT_KEY):
            assert secret not in text, (secret, event)

    with rendered_logs() as buffer:
        calls = await exercise_with_keys(http, hal0d)
        await eventually(lambda: buffer.getvalue().count('"request.done"') >= calls, 2.0,
                         "every request's request.done line, rendered")
    text = buffer.getvalue()
    assert text.count('"request.done"') == calls, text
    for secret in (KEY, WRONG_KEY, SLOT_KEY):
        assert secret not in text, (secret, re.findall(f".*{secret}.*", text))
    print(f"log leak check: {2 * calls} requests, {len(events)} events and "
          f"{len(text.splitlines())} rendered lines searched, keys found: 0")


@pytest.mark.parametrize(
    "host, keys, warned",
    [
        ("0.0.0.0", (), True),
        ("::", (), True),
        ("192.168.1.20", (), True),
        ("0.0.0.0", (KEY,), False),
        ("127.0.0.1", (), False),
        ("::1", (), False),
        ("localhost", (), False),
    ],
)
async def test_server_unprotected_is_warned_for_a_non_loopback_host_without_keys(
    host, keys, warned, tmp_path
):
    app = make_app(keyed_config("http://127.0.0.1:9", tmp_path, host=host, keys=keys))
    with capture_logs() as events:
        await warn_if_exposed(app)
    found = [e for e in events if e["event"] == "server.unprotected"]
    if warned:
        assert len(found) == 1, events
        assert found[0]["log_level"] == "warning" and found[0]["host"] == host
    else:
        assert found == [], events


async def test_a_key_with_bytes_that_are_not_utf8_is_refused_with_401_not_a_500(
    start_hal0d, stub, tmp_path
):
    config = make_config(stub.url, tmp_path=tmp_path)
    config = dataclasses.replace(
        config, server=ServerConfig(api_keys=("sk-good",), accepted_keys=frozenset({"sk-good"}))
    )
    hal0d = await start_hal0d(stub.url, config=config)
    reader, writer = await asyncio.open_connection(hal0d.host, hal0d.port)
    for header in (b"Authorization: Bearer \xff\xfe", b"x-api-key: caf\xc3"):
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n" + header + b"\r\n\r\n")
        await writer.drain()
        status = await reader.readline()
        assert status.startswith(b"HTTP/1.1 401"), status
        length = 0
        while (line := await reader.readline()) != b"\r\n":
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        assert b"authentication_error" in await reader.readexactly(length)
    writer.close()
