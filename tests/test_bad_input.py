"""Bad input on every surface: a 4xx in the surface's own envelope, never a 5xx, never a traceback,
and a history row with ok = 0 for every refused request. The Anthropic surface names the field."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp.test_utils import TestServer

from hal0d.config import ServerConfig
from tests.harness.config import make_config

OPENAI_PATHS = ("/v1/chat/completions", "/llm/v1/chat/completions")
ANTHROPIC_PATHS = ("/llm/v1/messages", "/v1/messages")
TOO_MANY_MESSAGES = 100_001


def openai_body(**changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "chat", "stream": False, "max_tokens": 8,
        "messages": [{"role": "user", "content": "hi"}],
    }
    body.update(changes)
    return {key: value for key, value in body.items() if value is not DROP}


def anthropic_body(**changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "chat", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
    }
    body.update(changes)
    return {key: value for key, value in body.items() if value is not DROP}


DROP = object()


@dataclass(frozen=True)
class Case:
    """One bad request, for the OpenAI surface (`openai`) and the Anthropic one (`anthropic`).

    Each side is raw bytes to post, or None when the case only exists on the other surface.
    `field` is what the Anthropic error message must start with (and the OpenAI `param`).
    """

    openai: bytes | None
    anthropic: bytes | None
    status: int = 400
    field: str | None = None
    openai_field: str | None = None


def js(body: Any) -> bytes:
    return orjson.dumps(body)


MANY = [{"role": "user", "content": "x"}] * TOO_MANY_MESSAGES

CASES: dict[str, Case] = {
    "malformed JSON": Case(b'{"model": "chat", "messages": [', b'{"model": "chat", "max_tokens"'),
    "empty body": Case(b"", b""),
    "body is an array": Case(b"[1, 2]", b"[1, 2]"),
    "body is a string": Case(b'"hello"', b'"hello"'),
    "body is a number": Case(b"42", b"42"),
    "body is null": Case(b"null", b"null"),
    "model is a number": Case(js(openai_body(model=7)), js(anthropic_body(model=7)),
                              field="model", openai_field="model"),
    "model is missing": Case(js(openai_body(model=DROP)), js(anthropic_body(model=DROP)),
                             field="model", openai_field="model"),
    "model is empty": Case(js(openai_body(model="")), js(anthropic_body(model="")),
                           field="model", openai_field="model"),
    "messages is a string": Case(js(openai_body(messages="hi")),
                                 js(anthropic_body(messages="hi")),
                                 field="messages", openai_field="messages"),
    "messages is missing": Case(js(openai_body(messages=DROP)),
                                js(anthropic_body(messages=DROP)),
                                field="messages", openai_field="messages"),
    "messages is empty": Case(js(openai_body(messages=[])), js(anthropic_body(messages=[])),
                              field="messages", openai_field="messages"),
    "a message is a string": Case(js(openai_body(messages=["hi"])),
                                  js(anthropic_body(messages=["hi"])),
                                  field="messages.0", openai_field="messages.0"),
    "a role is a number": Case(js(openai_body(messages=[{"role": 5, "content": "x"}])),
                               js(anthropic_body(messages=[{"role": 5, "content": "x"}])),
                               field="messages.0.role", openai_field="messages.0"),
    "a role is unknown (anthropic)": Case(
        None, js(anthropic_body(messages=[{"role": "user", "content": "x"},
                                          {"role": "robot", "content": "x"}])),
        field="messages.1.role"),
    "content is a number (anthropic)": Case(
        None, js(anthropic_body(messages=[{"role": "user", "content": 5}])),
        field="messages.0.content"),
    "a content block has no type (anthropic)": Case(
        None, js(anthropic_body(messages=[{"role": "user", "content": [{"text": "x"}]}])),
        field="messages.0.content.0.type"),
    "a tool has no input_schema (anthropic)": Case(
        None, js(anthropic_body(tools=[{"name": "lookup"}])), field="tools.0.input_schema"),
    "stream is a string": Case(js(openai_body(stream="yes")), js(anthropic_body(stream="yes")),
                               field="stream", openai_field="stream"),
    "temperature is a string": Case(js(openai_body(temperature="hot")),
                                    js(anthropic_body(temperature="hot")),
                                    field="temperature", openai_field="temperature"),
    "max_tokens is a string": Case(js(openai_body(max_tokens="8")),
                                   js(anthropic_body(max_tokens="8")),
                                   field="max_tokens", openai_field="max_tokens"),
    "max_tokens is a float": Case(js(openai_body(max_tokens=8.5)),
                                  js(anthropic_body(max_tokens=8.5)),
                                  field="max_tokens", openai_field="max_tokens"),
    "max_tokens is a boolean": Case(js(openai_body(max_tokens=True)),
                                    js(anthropic_body(max_tokens=True)),
                                    field="max_tokens", openai_field="max_tokens"),
    "max_tokens is missing (anthropic requires it)": Case(
        None, js(anthropic_body(max_tokens=DROP)), field="max_tokens"),
    "max_tokens is negative": Case(js(openai_body(max_tokens=-1)),
                                   js(anthropic_body(max_tokens=-1)),
                                   field="max_tokens", openai_field="max_tokens"),
    "max_tokens is zero": Case(js(openai_body(max_tokens=0)), js(anthropic_body(max_tokens=0)),
                               field="max_tokens", openai_field="max_tokens"),
    "max_tokens is absurd": Case(js(openai_body(max_tokens=10**12)),
                                 js(anthropic_body(max_tokens=10**12)),
                                 field="max_tokens", openai_field="max_tokens"),
    "max_tokens beyond 64 bits": Case(
        b'{"model":"chat","max_tokens":123456789012345678901234567890,'
        b'"messages":[{"role":"user","content":"x"}]}',
        b'{"model":"chat","max_tokens":123456789012345678901234567890,'
        b'"messages":[{"role":"user","content":"x"}]}',
        field="max_tokens", openai_field="max_tokens"),
    "max_completion_tokens is negative": Case(js(openai_body(max_completion_tokens=-5)), None,
                                              openai_field="max_completion_tokens"),
    "invalid UTF-8 in the body": Case(
        b'{"model": "chat", "max_tokens": 8, "messages": [{"role": "user", '
        b'"content": "\xff\xfe"}]}',
        b'{"model": "chat", "max_tokens": 8, "messages": [{"role": "user", '
        b'"content": "\xc3\x28"}]}'),
    "a lone surrogate escape": Case(
        b'{"model": "chat", "messages": [{"role": "user", "content": "\\ud800"}]}',
        b'{"model": "chat", "max_tokens": 8, "messages": [{"role": "user", '
        b'"content": "\\udfff"}]}'),
    "unknown model": Case(js(openai_body(model="gpt-nonexistent")),
                          js(anthropic_body(model="claude-nonexistent")), status=404),
    "too many messages": Case(js(openai_body(messages=MANY)), js(anthropic_body(messages=MANY)),
                              field="messages", openai_field="messages"),
}


def db_rows(path: Path) -> dict[str, dict[str, Any]]:
    if not path.exists():
        return {}
    with closing(sqlite3.connect(path)) as conn:
        conn.row_factory = sqlite3.Row
        return {row["request_id"]: dict(row) for row in conn.execute("SELECT * FROM requests")}


async def wait_rows(path: Path, request_ids: set[str], timeout: float = 5.0
                    ) -> dict[str, dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        rows = db_rows(path)
        if request_ids <= rows.keys():
            return rows
        assert time.monotonic() < deadline, f"no history rows for {request_ids - rows.keys()}"
        await asyncio.sleep(0.05)


def check_envelope(path: str, status: int, raw: bytes, expected_status: int, *,
                   field: str | None = None, openai_field: str | None = None) -> str | None:
    """The problem with one answer, or None when it is the right 4xx in the right envelope."""
    if status != expected_status:
        return f"status {status}, expected {expected_status}: {raw[:300]!r}"
    if b"Traceback" in raw:
        return f"traceback in the body: {raw[:300]!r}"
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return f"body is not JSON: {raw[:300]!r}"
    if path in ANTHROPIC_PATHS:
        if body.get("type") != "error" or set(body) != {"type", "error"}:
            return f"not the Anthropic error envelope: {body}"
        error = body["error"]
        expected_type = {400: "invalid_request_error", 404: "not_found_error",
                         405: "invalid_request_error", 413: "request_too_large"}[expected_status]
        if error.get("type") != expected_type:
            return f"error type {error.get('type')!r}, expected {expected_type!r}"
        if not isinstance(error.get("message"), str) or not error["message"]:
            return f"no message: {body}"
        if field is not None and not error["message"].startswith(f"{field}:"):
            return f"message does not name the field {field!r}: {error['message']!r}"
    else:
        error = body.get("error")
        if set(body) != {"error"} or not isinstance(error, dict):
            return f"not the OpenAI error envelope: {body}"
        if not isinstance(error.get("message"), str) or not error["message"]:
            return f"no message: {body}"
        expected_type = {400: "invalid_request_error", 404: "not_found_error",
                         405: "invalid_request_error", 413: "invalid_request_error"}
        if error.get("type") != expected_type[expected_status]:
            return f"error type {error.get('type')!r}, expected {expected_type[expected_status]!r}"
        if openai_field is not None and error.get("param") != openai_field:
            return f"param {error.get('param')!r}, expected {openai_field!r}"
    return None


async def post(http: aiohttp.ClientSession, hal0d: TestServer, path: str, data: bytes, *,
               request_id: str, method: str = "POST") -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
    async with http.request(method, hal0d.make_url(path), data=data, headers=headers) as resp:
        return resp.status, await resp.read()


async def test_every_bad_request_is_a_4xx_in_the_surface_envelope_with_an_ok_0_history_row(
    stub, start_hal0d, http, tmp_path
):
    hal0d = await start_hal0d(stub.url)
    failures: list[str] = []
    expected: dict[str, int] = {}
    tried = 0
    for index, (name, case) in enumerate(CASES.items()):
        for path in OPENAI_PATHS + ANTHROPIC_PATHS:
            anthropic = path in ANTHROPIC_PATHS
            data = case.anthropic if anthropic else case.openai
            if data is None:
                continue
            tried += 1
            request_id = f"bad-{index}-{path.replace('/', '_')}"
            status, raw = await post(http, hal0d, path, data, request_id=request_id)
            problem = check_envelope(path, status, raw, case.status,
                                     field=case.field if anthropic else None,
                                     openai_field=None if anthropic else case.openai_field)
            if problem:
                failures.append(f"{name} on {path}: {problem}")
            expected[request_id] = case.status
    rows = await wait_rows(tmp_path / "history.sqlite3", set(expected))
    for request_id, status in expected.items():
        row = rows[request_id]
        if (row["ok"], row["status"]) != (0, status) or not row["error_code"]:
            failures.append(f"{request_id}: history row ok={row['ok']} status={row['status']} "
                            f"error_code={row['error_code']!r}")
    print(f"bad input: {tried} bad requests tried on 4 paths, failures: {len(failures)}")
    assert not failures, "\n".join(failures)


async def test_the_message_count_limit_exists_on_both_surfaces_and_a_request_under_it_passes(
    stub, start_hal0d, http
):
    """100_001 tiny messages are refused before any slot is taken; 2 pass: the limit is a limit,
    not a refusal of every list."""
    hal0d = await start_hal0d(stub.url)
    few = [{"role": "user", "content": "x"}] * 2
    for path, make in (("/v1/chat/completions", openai_body),
                       ("/llm/v1/messages", anthropic_body)):
        status, raw = await post(http, hal0d, path, js(make(messages=MANY)),
                                 request_id=f"many{path}")
        assert status == 400, raw[:300]
        assert "100000" in raw.decode() or "100_000" in raw.decode(), raw[:300]
        status, raw = await post(http, hal0d, path, js(make(messages=few)),
                                 request_id=f"few{path}")
        assert status == 200, raw[:300]


async def test_wrong_method_is_405_in_the_surface_envelope_with_an_ok_0_row(
    stub, start_hal0d, http, tmp_path
):
    hal0d = await start_hal0d(stub.url)
    failures = []
    ids = set()
    for method in ("GET", "PUT", "DELETE", "PATCH"):
        for path in OPENAI_PATHS + ANTHROPIC_PATHS:
            request_id = f"method-{method}-{path.replace('/', '_')}"
            ids.add(request_id)
            status, raw = await post(http, hal0d, path, b"{}", request_id=request_id,
                                     method=method)
            if problem := check_envelope(path, status, raw, 405):
                failures.append(f"{method} {path}: {problem}")
    rows = await wait_rows(tmp_path / "history.sqlite3", ids)
    failures += [f"{i}: row {rows[i]}" for i in ids if rows[i]["ok"] != 0
                 or rows[i]["status"] != 405]
    assert not failures, "\n".join(failures)


async def test_body_over_max_body_bytes_is_413_in_the_surface_envelope_and_hal0d_keeps_serving(
    stub, start_hal0d, http, tmp_path
):
    hal0d = await start_hal0d(stub.url, config=make_config(
        stub.url, tmp_path=tmp_path, server=ServerConfig(max_body_bytes=2048)))
    big = "x" * 4096
    ids = set()
    for path, make in [(p, openai_body) for p in OPENAI_PATHS] + [
        (p, anthropic_body) for p in ANTHROPIC_PATHS
    ]:
        request_id = f"big{path.replace('/', '_')}"
        ids.add(request_id)
        status, raw = await post(http, hal0d, path,
                                 js(make(messages=[{"role": "user", "content": big}])),
                                 request_id=request_id)
        assert check_envelope(path, status, raw, 413) is None, (path, status, raw)
        # Just under the bound is served: the limit is the configured one.
        status, raw = await post(http, hal0d, path, js(make()),
                                 request_id=f"small{request_id}")
        assert status == 200, (path, raw[:300])
    rows = await wait_rows(tmp_path / "history.sqlite3", ids)
    assert all((rows[i]["ok"], rows[i]["status"]) == (0, 413) for i in ids), rows
