"""Fuzzing with hypothesis: request bodies against a running hal0d in front of the stub (both
surfaces). Upstream byte streams through the translator and the relay are in test_fuzz_streams.py.

hal0d and the stub run once per test on a dedicated event loop that the (synchronous) hypothesis
test drives, so a thousand examples cost a thousand round trips and nothing more.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import hdrs, web
from aiohttp.test_utils import TestServer
from hypothesis import given
from hypothesis import strategies as st
from structlog.testing import capture_logs

from hal0d.app import make_app
from hal0d_stub.app import make_stub_app
from tests.anthropic_rules import assert_valid_anthropic_stream, events_from_sse
from tests.harness.config import make_config
from tests.harness.fuzzing import EXAMPLES, FUZZ, json_values

# The stub's models that answer at once; stall and chatty never finish a non-streaming answer.
MODELS = ("chat", "reasoning", "think-only", "tool", "broken")
PREPARED = web.RequestKey("fuzz_stub_prepared", bool)


# -- hal0d and the stub on a loop of their own --------------------------------------------------


@dataclass
class Live:
    loop: asyncio.AbstractEventLoop
    hal0d: TestServer
    http: aiohttp.ClientSession
    events: list[dict[str, Any]]
    stub_crashes: list[str] = field(default_factory=list)
    statuses: Counter[int] = field(default_factory=Counter)

    def post(self, path: str, data: bytes, content_type: str = "application/json"
             ) -> tuple[int, bytes, list[dict[str, Any]]]:
        """One request; the status, the body, and the log events it caused."""
        before = len(self.events)

        async def go() -> tuple[int, bytes]:
            async with self.http.post(self.hal0d.make_url(path), data=data,
                                      headers={hdrs.CONTENT_TYPE: content_type}) as resp:
                return resp.status, await resp.read()

        status, raw = self.loop.run_until_complete(go())
        self.statuses[status] += 1
        return status, raw, self.events[before:]


@contextmanager
def live_hal0d(tmp_path: Path) -> Iterator[Live]:
    loop = asyncio.new_event_loop()
    crashes: list[str] = []
    stub_app = make_stub_app(tmp_path / "stub.log", 0.0)

    async def mark_prepared(request: web.Request, response: web.StreamResponse) -> None:
        request[PREPARED] = True

    @web.middleware
    async def stub_never_answers_500(request: web.Request, handler: Any) -> web.StreamResponse:
        """The stub is not what is under test: a body it cannot handle becomes its 400, so
        any 5xx the client sees was made by hal0d. (After its headers the stub just breaks the
        stream, which hal0d must turn into an error event.)"""
        try:
            return await handler(request)
        except web.HTTPException:
            raise
        except Exception as exc:
            crashes.append(repr(exc))
            if request.get(PREPARED):
                raise
            return web.json_response({"error": {"message": f"stub: {exc!r}"}}, status=400)

    stub_app.middlewares.append(stub_never_answers_500)
    stub_app.on_response_prepare.append(mark_prepared)

    async def start() -> tuple[TestServer, TestServer, aiohttp.ClientSession]:
        stub = TestServer(stub_app)
        await stub.start_server()
        config = make_config(str(stub.make_url("")).rstrip("/"), tmp_path=tmp_path,
                             slot={"max_concurrent": 4})
        hal0d = TestServer(make_app(config))
        await hal0d.start_server()
        return stub, hal0d, aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20))

    stub, hal0d, http = loop.run_until_complete(start())
    try:
        with capture_logs() as events:
            yield Live(loop, hal0d, http, events, crashes)
    finally:
        loop.run_until_complete(http.close())
        loop.run_until_complete(hal0d.close())
        loop.run_until_complete(stub.close())
        loop.close()


# -- request bodies -------------------------------------------------------------------------------
#
# A body is a valid one with 0 to 3 mutations at random places of its JSON tree (a value replaced
# by any JSON value, a key deleted, a key added, a real field name included), or any JSON value at
# all. Most bodies are thus nearly right, which is where validation code has its corners.

small_int = st.integers(min_value=1, max_value=24)
texts = st.text(max_size=30)
streams = st.sampled_from([False] * 8 + [True])
REAL_KEYS = (
    "model", "messages", "max_tokens", "max_completion_tokens", "stream", "temperature", "top_p",
    "top_k", "stream_options", "include_usage", "tools", "tool_choice", "stop", "stop_sequences",
    "role", "content", "type", "text", "source", "image_url", "url", "id", "name", "input",
    "tool_use_id", "tool_calls", "function", "arguments", "system", "metadata", "user_id",
    "input_schema", "description", "disable_parallel_tool_use", "media_type", "data",
)
openai_tool = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["lookup", "calc"]), "parameters": st.just({"type": "object"})})})
valid_openai = st.fixed_dictionaries(
    {"model": st.sampled_from((*MODELS, *MODELS, "no-such-model")),
     "messages": st.lists(st.fixed_dictionaries(
         {"role": st.sampled_from(["user", "assistant", "system"]), "content": texts}),
         min_size=1, max_size=3)},
    optional={
        "max_tokens": small_int, "max_completion_tokens": small_int, "stream": streams,
        "temperature": st.floats(0, 2), "top_p": st.floats(0, 1),
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
        "stop": st.lists(texts, max_size=2), "seed": st.integers(0, 2**31),
        "tools": st.lists(openai_tool, min_size=1, max_size=2), "tool_choice": st.just("auto"),
        "user": texts, "n": st.just(1),
    },
)
text_block = st.fixed_dictionaries({"type": st.just("text"), "text": texts})
image_block = st.fixed_dictionaries({"type": st.just("image"), "source": st.sampled_from([
    {"type": "base64", "media_type": "image/png", "data": "aGk="},
    {"type": "url", "url": "https://example.invalid/a.png"},
])})
tool_use_block = st.fixed_dictionaries({"type": st.just("tool_use"), "id": st.just("toolu_1"),
                                        "name": st.just("lookup"),
                                        "input": st.just({"q": "x"})})
tool_result_block = st.fixed_dictionaries(
    {"type": st.just("tool_result"), "tool_use_id": st.just("toolu_1")},
    optional={"content": texts | st.lists(text_block, max_size=2)})
thinking_block = st.fixed_dictionaries({"type": st.just("thinking"), "thinking": texts,
                                        "signature": st.just("")})
user_message = st.fixed_dictionaries({"role": st.just("user"), "content": texts | st.lists(
    text_block | image_block | tool_result_block, min_size=1, max_size=3)})
assistant_message = st.fixed_dictionaries({"role": st.just("assistant"), "content": texts
                                           | st.lists(text_block | tool_use_block
                                                      | thinking_block, min_size=1, max_size=3)})
anthropic_tool = st.fixed_dictionaries(
    {"name": st.sampled_from(["lookup", "calc"]), "input_schema": st.just({"type": "object"})},
    optional={"description": texts, "type": st.just("custom")})
valid_anthropic = st.fixed_dictionaries(
    {"model": st.sampled_from((*MODELS, *MODELS, "no-such-model")), "max_tokens": small_int,
     "messages": st.lists(user_message | assistant_message, min_size=1, max_size=3)},
    optional={
        "stream": streams, "system": texts | st.lists(text_block, max_size=2),
        "temperature": st.floats(0, 1), "top_p": st.floats(0, 1), "top_k": small_int,
        "stop_sequences": st.lists(texts, max_size=2),
        "tools": st.lists(anthropic_tool, min_size=1, max_size=2),
        "tool_choice": st.sampled_from([{"type": "auto"}, {"type": "any"}, {"type": "none"},
                                        {"type": "tool", "name": "lookup"},
                                        {"type": "auto", "disable_parallel_tool_use": True}]),
        "metadata": st.fixed_dictionaries({"user_id": texts}),
        "thinking": st.just({"type": "enabled", "budget_tokens": 1024}),
    },
)


def locations(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield path
    if isinstance(value, dict):
        for key, item in value.items():
            yield from locations(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from locations(item, (*path, index))


@st.composite
def mutated(draw: st.DrawFn, valid: st.SearchStrategy[dict[str, Any]]) -> Any:
    body: Any = copy.deepcopy(draw(valid))  # st.just and sampled_from hand out shared objects
    for _ in range(draw(st.sampled_from([0, 1, 1, 1, 2, 3]))):
        path = draw(st.sampled_from(list(locations(body))))
        action = draw(st.sampled_from(["replace", "replace", "delete", "add"]))
        if not path:
            if action == "replace":
                body = draw(json_values)
            continue
        parent = body
        for step in path[:-1]:
            parent = parent[step]
        last = path[-1]
        if action == "replace":
            parent[last] = draw(json_values)
        elif action == "delete":
            del parent[last]
        else:
            target = parent[last]
            if isinstance(target, dict):
                target[draw(st.sampled_from(REAL_KEYS) | st.text(max_size=8))] = draw(json_values)
            elif isinstance(target, list):
                target.insert(draw(st.integers(0, len(target))), draw(json_values))
            else:
                parent[last] = [target, draw(json_values)]
    return body


def without_long(value: Any) -> Any:
    """The stub streams until max_tokens when the last user message is exactly "long"."""
    if value == "long":
        return "long."
    if isinstance(value, list):
        return [without_long(item) for item in value]
    if isinstance(value, dict):
        return {key: without_long(item) for key, item in value.items()}
    return value


def encoded(body: Any, how: str) -> bytes:
    """The body as a client might send it: JSON (NaN, huge ints and all), raw UTF-8 that may
    hold lone surrogates, or cut short."""
    body = without_long(body)
    if how == "ascii":
        return json.dumps(body).encode()
    if how == "raw":
        return json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")
    data = json.dumps(body).encode()
    return data[: max(0, len(data) - 3)]


encodings = st.sampled_from(["ascii"] * 7 + ["raw"] * 2 + ["cut"])
requests_openai = st.tuples(
    mutated(valid_openai) | mutated(valid_openai) | mutated(valid_openai) | json_values,
    encodings)
requests_anthropic = st.tuples(
    mutated(valid_anthropic) | mutated(valid_anthropic) | mutated(valid_anthropic) | json_values,
    encodings)


def cut_by_the_stub(body: Any) -> bool:
    """The stub's `broken` model cuts a non-streamed answer mid-body: hal0d's 502 in the envelope
    is then the right answer, and the only 5xx a fuzzed body may get."""
    return (isinstance(body, dict) and body.get("model") == "broken"
            and body.get("stream") is not True)


def surface_problem(path: str, status: int, raw: bytes, events: list[dict[str, Any]],
                    *, may_be_502: bool = False) -> str | None:
    if status >= 500 and not (may_be_502 and status == 502):
        return f"status {status}: {raw[:300]!r}"
    if b"Traceback" in raw:
        return "a traceback in the body"
    failed = [e for e in events if e["event"] == "request.failed"
              or e.get("log_level") in ("error", "critical")]
    if failed:
        return f"unhandled exception: {failed}"
    if status >= 400:
        body = orjson.loads(raw)
        shape_ok = (body.get("type") == "error" and isinstance(body["error"]["message"], str)
                    if path.endswith("/messages")
                    else isinstance(body.get("error"), dict))
        if not shape_ok:
            return f"{status} without the surface's error envelope: {raw[:300]!r}"
    elif path.endswith("/messages"):
        if raw.startswith(b"event: "):
            assert_valid_anthropic_stream(events_from_sse(raw))
        elif orjson.loads(raw).get("type") != "message":
            return f"200 that is neither a stream nor a message: {raw[:300]!r}"
    return None


def fuzz_surface(tmp_path: Path, path: str, strategy: st.SearchStrategy[Any]) -> None:
    with live_hal0d(tmp_path) as live:
        problems: list[str] = []
        cut: list[int] = []

        @FUZZ
        @given(strategy)
        def one(request: tuple[Any, str]) -> None:
            body, how = request
            status, raw, events = live.post(path, encoded(body, how))
            may_be_502 = cut_by_the_stub(body)
            if may_be_502 and status == 502:
                cut.append(status)
            problem = surface_problem(path, status, raw, events, may_be_502=may_be_502)
            if problem:
                problems.append(problem)
            assert problem is None, (problem, body)

        one()
        tried = sum(live.statuses.values())
        print(f"fuzz {path}: {tried} bodies, statuses {dict(sorted(live.statuses.items()))}, "
              f"5xx: {sum(n for s, n in live.statuses.items() if s >= 500) - len(cut)} "
              f"(and {len(cut)} 502s for the broken model's cut answers), "
              f"request.failed: 0, failures: {len(problems)} "
              f"(stub could not handle {len(live.stub_crashes)})")
        assert tried >= EXAMPLES
        # Not vacuous: a good share of the bodies went all the way to the upstream.
        assert sum(n for s, n in live.statuses.items() if s == 200) >= EXAMPLES // 5


def test_fuzzed_openai_bodies_never_get_a_5xx_a_traceback_or_an_unhandled_exception(tmp_path):
    fuzz_surface(tmp_path, "/v1/chat/completions", requests_openai)


def test_fuzzed_anthropic_bodies_never_get_a_5xx_a_traceback_or_an_unhandled_exception(tmp_path):
    fuzz_surface(tmp_path, "/llm/v1/messages", requests_anthropic)
