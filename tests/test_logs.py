"""The logging pipeline as it renders: the journald `<N>` prefix, JSON lines, stdlib loggers, and
no secret in any line, whatever carries it there."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

import aiohttp
import orjson
import pytest
import structlog
from hypothesis import given, settings
from hypothesis import strategies as st

from hal0d import logs
from hal0d.config import parse
from tests.harness.client import chat_body
from tests.harness.daemons import ServerFactory
from tests.harness.logs import logs_into_buffer
from tests.harness.poll import eventually
from tests.harness.stubs import Stub

CLIENT_KEY = "sk-secret-client-key-4f9Q2"
SLOT_KEY = "upstream-slot-key-Hq81z"  # no recognisable shape: only hide() can catch it
ISO_TIME = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}")

Configure = Callable[..., Path]


@pytest.fixture
def configure_logs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Configure]:
    """logs.configure() into a real file; the global logging state is restored afterwards."""
    saved = {**structlog.get_config(), "processors": list(structlog.get_config()["processors"])}
    root = logging.getLogger()
    saved_root = (root.handlers[:], root.level)
    access = logging.getLogger("aiohttp.access")
    saved_access = access.disabled
    saved_hidden = logs._hidden
    streams: list[TextIO] = []

    def configure(fmt: str = "auto", level: str = "info", journal: str | None = None) -> Path:
        path = tmp_path / f"log-{len(streams)}.txt"
        stream = path.open("w", buffering=1)
        streams.append(stream)
        if journal == "this file":
            stat = os.fstat(stream.fileno())
            monkeypatch.setenv("JOURNAL_STREAM", f"{stat.st_dev}:{stat.st_ino}")
        elif journal is not None:
            monkeypatch.setenv("JOURNAL_STREAM", journal)
        else:
            monkeypatch.delenv("JOURNAL_STREAM", raising=False)
        logs.configure(level=level, fmt=fmt, stream=stream)
        return path

    yield configure
    structlog.configure(**saved)
    root.handlers[:] = saved_root[0]
    root.setLevel(saved_root[1])
    access.disabled = saved_access
    logs.hide(saved_hidden)
    for stream in streams:
        stream.close()


def test_under_journald_lines_carry_the_syslog_priority_and_no_timestamp(
    configure_logs: Configure,
) -> None:
    path = configure_logs(journal="this file")
    log = logs.get_logger()
    log.info("request.done", request_id="r1", slot="llm", model="chat")
    log.warning("slot.state_changed", slot="llm", old="ready", new="error")
    log.error("server.bind_failed", port=8080)
    logging.getLogger("aiohttp.server").warning("Error handling request")
    lines = path.read_text().splitlines()

    # journald stamps each line itself; `journalctl -p warning` reads the prefix.
    assert lines == [
        "<6>request.done request_id=r1 slot=llm model=chat",
        "<4>slot.state_changed slot=llm old=ready new=error",
        "<3>server.bind_failed port=8080",
        "<4>Error handling request logger=aiohttp.server",
    ]
    assert not any(ISO_TIME.search(line) for line in lines)


def test_a_logfmt_value_is_quoted_exactly_when_a_space_quote_equals_newline_tab_or_backslash(
    configure_logs: Configure,
) -> None:
    path = configure_logs(fmt="journald")
    plain = {"a": "/v1/chat/completions", "b": 200, "c": None, "d": True, "e": 0.31,
             "f": "kv-cache_full"}
    quoted = {"g": "two words", "h": 'say "hi"', "i": "k=v", "j": "line\nbreak", "k": "tab\tbed",
              "l": "back\\slash", "m": ""}
    logs.get_logger().info("request.done", **plain, **quoted)
    line = path.read_text().strip()
    assert line.startswith("<6>request.done ")
    # Each quoted value is the JSON string of the text, so a reader gets back what was logged.
    fields = dict(re.findall(r' ([a-m])=("(?:[^"\\]|\\.)*"|\S*)', line))
    assert fields == {**{k: str(v) for k, v in plain.items()},
                      **{k: orjson.dumps(v).decode() for k, v in quoted.items()}}
    assert {k: orjson.loads(fields[k]) for k in quoted} == quoted


def test_a_journal_stream_that_is_not_our_stdout_is_not_journald(
    configure_logs: Configure,
) -> None:
    # A child of a service inherits JOURNAL_STREAM while its stdout may go elsewhere.
    path = configure_logs(journal="1:2")
    logs.get_logger().info("server.started", port=8080)
    line = path.read_text().strip()
    assert not line.startswith("<")
    assert ISO_TIME.match(line) and "[info] server.started port=8080" in line


def test_json_format_gives_one_parseable_object_per_line_stdlib_included(
    configure_logs: Configure,
) -> None:
    path = configure_logs(fmt="json", journal="this file")  # an explicit format wins
    log = logs.get_logger()
    log.info("request.done", request_id="r1", status=200, ok=True, ttft_ms=12.5)
    logging.getLogger("aiohttp.access").info("must not appear: request.done replaces it")
    logging.getLogger("aiohttp.server").error("Error handling request")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("request.failed", path="/v1/chat/completions")
    events = [orjson.loads(line) for line in path.read_text().splitlines()]

    assert [e["event"] for e in events] == [
        "request.done", "Error handling request", "request.failed",
    ]
    assert events[0] | {"timestamp": None} == {
        "event": "request.done", "level": "info", "request_id": "r1", "status": 200,
        "ok": True, "ttft_ms": 12.5, "timestamp": None,
    }
    assert ISO_TIME.match(events[0]["timestamp"])
    assert events[1]["level"] == "error" and events[1]["logger"] == "aiohttp.server"
    assert "ValueError: boom" in events[2]["exception"]


def test_no_secret_survives_any_way_into_a_line(configure_logs: Configure) -> None:
    path = configure_logs(fmt="logfmt", level="debug")
    logs.hide([SLOT_KEY])
    log = logs.get_logger()
    log.info("upstream.request", headers={"Authorization": f"Bearer {CLIENT_KEY}",
                                          "X-Api-Key": CLIENT_KEY, "Accept": "*/*"})
    log.info("config.loaded", api_key=SLOT_KEY, authorization=f"Bearer {CLIENT_KEY}")
    log.warning("dispatch.upstream_broken", error=f"401 for key {SLOT_KEY}")
    logging.getLogger("aiohttp.client").debug("sending x-api-key: %s", CLIENT_KEY)
    logging.getLogger("aiohttp.server").warning("bad header 'Authorization: Bearer %s'",
                                                CLIENT_KEY)
    try:
        raise RuntimeError(f"upstream said: invalid api_key={CLIENT_KEY}")
    except RuntimeError:
        log.exception("request.failed")
    text = path.read_text()

    assert len(text.splitlines()) == 6
    assert CLIENT_KEY not in text and SLOT_KEY not in text
    assert "sk-secret" not in text
    assert text.count(logs.REDACTED) >= 8
    assert "Accept=" in text or "'Accept': '*/*'" in text  # the rest is kept


async def test_a_request_carrying_api_keys_never_shows_them_in_the_log(
    configure_logs: Configure, stub: Stub, start_hal0d: ServerFactory,
    http: aiohttp.ClientSession, tmp_path: Path,
) -> None:
    """A real hal0d with client keys and a slot key: streamed, whole, refused and unroutable
    requests, each with `Authorization: Bearer` and `x-api-key`, at debug level."""
    path = configure_logs(fmt="json", level="debug", journal="this file")
    config = parse({
        "server": {"api_keys": [CLIENT_KEY]},
        "slots": [{"name": "llm", "upstream": stub.url, "api_key": SLOT_KEY,
                   "models": ["reasoning", "chat", "broken"]}],
        "metrics": {"database": str(tmp_path / "history.sqlite3")},
    }, base_dir=tmp_path)
    logs.hide([CLIENT_KEY, SLOT_KEY])  # what `hal0d serve` registers at start
    hal0d = await start_hal0d(stub.url, config=config)
    sent: list[tuple[dict[str, Any], dict[str, str]]] = [
        (chat_body("reasoning"), {"Authorization": f"Bearer {CLIENT_KEY}"}),
        (chat_body("chat", stream=False), {"x-api-key": CLIENT_KEY}),
        (chat_body("broken"), {"Authorization": f"Bearer {CLIENT_KEY}", "x-api-key": CLIENT_KEY}),
        (chat_body("no-such-model"), {"x-api-key": CLIENT_KEY}),
        (chat_body("chat"), {"Authorization": f"Bearer {CLIENT_KEY}-wrong"}),
        ({"model": 5}, {"x-api-key": f"{CLIENT_KEY}x"}),
    ]
    for body, headers in sent:
        async with http.post(hal0d.make_url("/v1/chat/completions"), json=body,
                             headers=headers) as response:
            await response.read()
    await eventually(lambda: path.read_text().count('"request.done"') >= len(sent), 2.0,
                     "every request's request.done line")
    text = path.read_text()
    events = [orjson.loads(line) for line in text.splitlines()]

    done = [event for event in events if event["event"] == "request.done"]
    assert len(done) == len(sent)  # the requests were logged, and nothing of their keys
    assert {event["status"] for event in done} >= {200, 401, 404}
    assert CLIENT_KEY not in text and "sk-secret" not in text
    assert SLOT_KEY not in text


def test_hide_holds_the_current_secrets_only() -> None:
    """Each reload hands hide() the secrets now configured: a replaced key is no longer
    searched for, the new one is redacted."""
    saved = logs._hidden
    try:
        logs.hide(["old-slot-key-Zp4", SLOT_KEY])
        logs.hide([SLOT_KEY, "new-slot-key-Wq7"])
        assert logs._hidden == {SLOT_KEY, "new-slot-key-Wq7"}
        assert logs.scrub("key new-slot-key-Wq7") == f"key {logs.REDACTED}"
        assert logs.scrub("key old-slot-key-Zp4") == "key old-slot-key-Zp4"
    finally:
        logs.hide(saved)


# The hint redact_secrets used before its substring tests: a case-insensitive regex.
_REGEX_HINT = re.compile(r"(?i)bearer|basic|api[-_]?key|authorization|password|secret|token|sk-")


def scrubbed_the_regex_way(value: Any, depth: int = 0) -> Any:
    if isinstance(value, str):
        for hidden in logs._hidden:
            value = value.replace(hidden, logs.REDACTED)
        if _REGEX_HINT.search(value):
            for pattern, replacement in logs._SECRET_SHAPES:
                value = pattern.sub(replacement, value)
        return value
    if depth > 2:
        return value
    if isinstance(value, dict):
        return {k: logs.REDACTED if isinstance(k, str) and k.lower() in logs.SECRET_KEYS
                else scrubbed_the_regex_way(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(scrubbed_the_regex_way(v, depth + 1) for v in value)
    return value


def redacted_field_by_field(event: dict[str, Any]) -> dict[str, Any]:
    """What redact_secrets did before its one-pass check: every key and every value on its own,
    with the regex hint. The one-pass check must change nothing of this."""
    out = {}
    for key, value in event.items():
        if key.startswith("_"):
            out[key] = value
        elif key.lower() in logs.SECRET_KEYS:
            out[key] = logs.REDACTED
        else:
            out[key] = scrubbed_the_regex_way(value)
    return out


# Text that is mostly harmless, with the words and shapes the redaction looks for mixed in.
_WORDS = st.sampled_from([
    "bench", "/v1/chat/completions", "POST", "Bearer", "bearer", "BEARER", "Basic", "basic",
    "api_key", "API-KEY", "x-api-key", "token", "Authorization", "password", "secret", "sk-",
    "sk-abcdefgh123", "=", ":", " ", "'", '"', "\n", "dGhpcyBpcyBhIGtleQ==", "paſsword",
    "slot-secret-value", "ok", "é", "İ",
])
_TEXT = st.lists(_WORDS, max_size=8).map("".join)
_KEYS = st.sampled_from(["model", "path", "request_id", "api_key", "Authorization", "token",
                         "reason", "detail", "_record", "status"])
_VALUES = st.one_of(
    _TEXT, st.integers(), st.floats(allow_nan=False), st.none(), st.booleans(),
    st.lists(_TEXT, max_size=3), st.dictionaries(_KEYS, _TEXT, max_size=3),
)


@settings(max_examples=500, deadline=None)
@given(st.dictionaries(_KEYS, _VALUES, max_size=8))
def test_the_one_pass_check_redacts_exactly_what_field_by_field_redaction_does(
    event: dict[str, Any],
) -> None:
    saved = logs._hidden
    try:
        logs.hide(["slot-secret-value"])
        assert logs.redact_secrets(None, "info", dict(event)) == redacted_field_by_field(event)
    finally:
        logs.hide(saved)


def test_a_cached_logger_follows_a_reconfigured_level_and_format() -> None:
    """`hal0d serve` caches each logger on its first use; a reload that changes [logging]
    configures again, and what a logger cached before writes changes with it."""
    with logs_into_buffer("json", "info") as buffer:
        log = structlog.wrap_logger(None, cache_logger_on_first_use=True)
        log.info("before.reload", n=1)
        log.debug("not.at.info")
        assert "bind" in vars(log), "the logger was assembled once and kept"
        logs.configure(level="debug", fmt="logfmt", stream=buffer, cache_loggers=True)
        assert structlog.get_config()["cache_logger_on_first_use"] is True
        log.debug("after.reload", n=2)
        logs.configure(level="warning", fmt="logfmt", stream=buffer, cache_loggers=True)
        log.info("not.at.warning")
        log.warning("at.warning", n=3)
    first, second, third = buffer.getvalue().splitlines()
    assert orjson.loads(first)["event"] == "before.reload"
    assert second.endswith("[debug] after.reload n=2"), second
    assert third.endswith("[warning] at.warning n=3"), third
