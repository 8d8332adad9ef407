"""Fuzzing with hypothesis: request bodies against a running hal0d in front of the stub (both
surfaces), and upstream byte streams through the Anthropic translator and the passthrough relay.

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
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from hal0d.anthropic.stream import Translator
from hal0d.anthropic.transform import AnthropicTransform
from hal0d.app import make_app
from hal0d.openai.transform import Passthrough
from hal0d.protocol.transform import TransformFailed
from hal0d_stub.app import make_stub_app
from tests.anthropic_rules import assert_valid_anthropic_stream, events_from_sse
from tests.harness.config import make_config

EXAMPLES = 1000
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.filter_too_much, HealthCheck.large_base_example],
)
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

leaves = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
          | st.floats() | st.text(max_size=12))
json_values = st.recursive(
    leaves,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=8,
)
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


# -- upstream byte streams ------------------------------------------------------------------------


def chunk_bytes(delta: dict[str, Any] | None = None, finish: Any = None,
                usage: dict[str, Any] | None = None) -> bytes:
    payload: dict[str, Any] = {"id": "c", "object": "chat.completion.chunk", "model": "m",
                               "choices": [] if delta is None else
                               [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage is not None:
        payload["usage"] = usage
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


deltas = st.sampled_from([
    {"role": "assistant", "content": None}, {"content": "Hel"}, {"content": "lo é🙂"},
    {"reasoning_content": "hmm"}, {"reasoning": "so"}, {"content": ""},
    {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                     "function": {"name": "lookup", "arguments": ""}}]},
    {"tool_calls": [{"index": 0, "function": {"arguments": "{\"q\": "}}]},
    {"tool_calls": [{"index": 1, "id": "call_2", "function": {"name": "other",
                                                              "arguments": "{}"}}]},
    {"content": "x", "reasoning_content": "y"},
]) | st.dictionaries(st.sampled_from(["content", "reasoning_content", "tool_calls", "role"]),
                     json_values, max_size=2)
finishes = st.sampled_from([None, None, "stop", "length", "tool_calls", "content_filter"]) \
    | json_values
usages = st.none() | st.fixed_dictionaries(
    {"prompt_tokens": st.integers(0, 50), "completion_tokens": st.integers(0, 50)}) | json_values
good_events = st.builds(chunk_bytes, deltas, finishes, usages)
bad_events = st.sampled_from([
    b"data: [DONE]\n\n", b"data: {\"choices\": [\n\n", b"data: \xff\xfe\n\n", b": ping\n\n",
    b"event: message\n", b"data: \n\n", b"\n\n", b"\r\n", b"data: null\n\n", b"data: []\n\n",
    b"data: {\"error\": {\"message\": \"boom\"}}\n\n", b"id: 7\nretry: 10\n",
    b"data: {\"choices\": \"x\"}\n\n", b"data: {\"usage\": {\"prompt_tokens\": -1}}\n\n",
    b"\xef\xbb\xbf", b"data:[DONE]\r\n\r\n",
]) | st.binary(max_size=24) | st.builds(lambda v: b"data: " + json.dumps(v).encode() + b"\n\n",
                                         json_values)
event_lists = st.lists(good_events | good_events | bad_events, max_size=14)


well_formed = st.builds(
    lambda deltas_, finish, usage, done: b"".join(
        [chunk_bytes({"role": "assistant", "content": None})]
        + [chunk_bytes(delta) for delta in deltas_]
        + ([chunk_bytes({}, finish)] if finish else [])
        + ([chunk_bytes(None, None, usage)] if usage else [])
        + ([b"data: [DONE]\n\n"] if done else [])
    ),
    st.lists(deltas, max_size=6),
    st.sampled_from([None, "stop", "length", "tool_calls"]),
    st.none() | st.fixed_dictionaries({"prompt_tokens": st.integers(0, 50),
                                       "completion_tokens": st.integers(0, 50)}),
    st.booleans(),
)


@st.composite
def byte_streams(draw: st.DrawFn) -> list[bytes]:
    """A well-formed stream, maybe with garbage spliced in, or events in any order; then maybe
    truncated mid-event, and cut at arbitrary points into reads."""
    if draw(st.booleans()):
        data = draw(well_formed)
        for _ in range(draw(st.sampled_from([0, 0, 1, 2]))):
            at = draw(st.integers(0, len(data)))
            data = data[:at] + draw(bad_events) + data[at:]
    else:
        data = b"".join(draw(event_lists))
    if data and draw(st.sampled_from([False, False, True])):
        data = data[: draw(st.integers(0, len(data)))]
    cuts = sorted(set(draw(st.lists(st.integers(0, len(data)), max_size=8))))
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    return [piece for piece in pieces if piece]


def translate(pieces: list[bytes]) -> bytes:
    """What the Anthropic surface writes for these upstream reads (relay's contract)."""
    transform = AnthropicTransform(Translator("claude-fuzz", input_tokens=3))
    out = b""
    try:
        for piece in pieces:
            out += transform.feed(piece)
        out += transform.end()
    except TransformFailed as failed:
        out += failed.frame
    return out


def test_fuzzed_upstream_streams_always_translate_into_valid_anthropic_events():
    endings: Counter[str] = Counter()

    @FUZZ
    @given(byte_streams())
    def one(pieces: list[bytes]) -> None:
        events = events_from_sse(translate(pieces))
        endings[assert_valid_anthropic_stream(events)] += 1

    one()
    print(f"fuzz translator: {sum(endings.values())} upstream byte streams, endings "
          f"{dict(endings)}, rule violations: 0, exceptions other than TransformFailed: 0")
    assert sum(endings.values()) >= EXAMPLES and endings["success"] and endings["error"]


DONE_LINES = (b"data: [DONE]", b"data:[DONE]")


def test_fuzzed_upstream_streams_pass_the_relay_verbatim_and_a_cut_one_is_never_called_complete():
    """The passthrough does not parse: it must deliver every byte as it came, and judge a stream
    complete exactly when it ends with `data: [DONE]` (trailing blank lines aside). A stream
    whose [DONE] line is split over three reads is the known bug tested below; here the final
    line arrives within the last read, as every server we know writes it."""
    verdicts: Counter[str] = Counter()

    @FUZZ
    @given(byte_streams())
    def one(pieces: list[bytes]) -> None:
        transform = Passthrough(sse=True, legacy_completion=False, model="m", expect_done=True)
        relayed = b"".join(transform.feed(piece) for piece in pieces)
        assert relayed == b"".join(pieces)  # verbatim, whatever the bytes
        complete = relayed.rstrip().endswith(DONE_LINES)
        try:
            tail = transform.end()
        except TransformFailed as failed:
            assert failed.error_code == "upstream_incomplete"
            assert failed.frame.startswith(b"\n\ndata: ") and failed.frame.endswith(b"}\n\n")
            error = orjson.loads(failed.frame.strip().removeprefix(b"data: "))["error"]
            assert error["code"] == "dispatch.upstream_incomplete" and error["message"]
            assert not (complete and pieces[-1].rstrip().endswith(DONE_LINES)), (
                "a complete stream was reported as cut")
            verdicts["cut"] += 1
            return
        assert tail == b""
        assert complete, f"a cut stream was passed as complete: {relayed[-80:]!r}"
        verdicts["complete"] += 1

    one()
    print(f"fuzz relay: {sum(verdicts.values())} upstream byte streams relayed byte for byte, "
          f"verdicts {dict(verdicts)}, cut streams passed as complete: 0")
    assert sum(verdicts.values()) >= EXAMPLES and verdicts["complete"] and verdicts["cut"]


async def test_a_complete_stream_whose_done_line_arrives_in_three_reads_is_complete(
    upstream_app, start_hal0d, http, tmp_path
):
    async def upstream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={hdrs.CONTENT_TYPE: "text/event-stream"})
        await response.prepare(request)
        for piece in (chunk_bytes({"content": "hi"}, "stop"), b"data: [DONE]", b"\n", b"\n"):
            await response.write(piece)
            await asyncio.sleep(0.05)  # each piece its own read
        await response.write_eof()
        return response

    url = await upstream_app({"POST /v1/chat/completions": upstream})
    hal0d = await start_hal0d(url)
    body = {"model": "chat", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    async with http.post(hal0d.make_url("/v1/chat/completions"), json=body,
                         headers={"X-Request-Id": "three-reads"}) as resp:
        raw = await resp.read()
    assert raw == chunk_bytes({"content": "hi"}, "stop") + b"data: [DONE]\n\n", raw[-200:]

