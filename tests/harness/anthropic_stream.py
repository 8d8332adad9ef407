"""What the Anthropic stream translator's tests share: OpenAI chunks as an upstream streams them,
built short (`chunk`, `role`, `think`, `say`, `call`, `finish`, `usage`), a script of them played
through the Translator (`play`), the Anthropic events read back in a short form (`short`) so each
case reads as the stream a client sees, the relay's way from upstream bytes to events
(`run_pipeline`), any upstream stream hypothesis can draw (`upstream_streams`), and the anthropic
SDK reading a body of our frames (`sdk_client`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson
from hypothesis import strategies as st

from hal0d.anthropic.stream import Event, MalformedChunk, State, Translator
from hal0d.protocol.sse import Decoder

if TYPE_CHECKING:
    import anthropic

DONE = "[DONE]"


def chunk(
    delta: dict[str, Any] | None = None,
    finish: str | None = None,
    usage: dict[str, int] | None = None,
    **choice: Any,
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish, **choice}],
    }
    if usage is not None:
        out["usage"] = usage
    return out


def role() -> dict[str, Any]:
    return chunk({"role": "assistant", "content": None})


def think(text: str, *, field: str = "reasoning_content", **kw: Any) -> dict[str, Any]:
    return chunk({field: text}, **kw)


def say(text: str, **kw: Any) -> dict[str, Any]:
    return chunk({"content": text}, **kw)


def call(
    index: int, args: str = "", *, id: str | None = None, name: str | None = None
) -> dict[str, Any]:
    entry: dict[str, Any] = {"index": index, "function": {"arguments": args}}
    if id is not None:
        entry["id"] = id
        entry["type"] = "function"
    if name is not None:
        entry["function"]["name"] = name
    return chunk({"tool_calls": [entry]})


def finish(reason: str = "stop", **kw: Any) -> dict[str, Any]:
    return chunk({}, finish=reason, **kw)


def usage(prompt: int, completion: int) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "choices": [],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
    }


def short(event: Event) -> tuple[Any, ...]:
    name, p = event
    if name == "message_start":
        return ("message_start", p["message"]["usage"]["input_tokens"])
    if name == "content_block_start":
        return ("start", p["index"], p["content_block"]["type"])
    if name == "content_block_delta":
        d = p["delta"]
        return ("delta", p["index"], d.get("thinking", d.get("text", d.get("partial_json"))))
    if name == "content_block_stop":
        return ("stop", p["index"])
    if name == "message_delta":
        u = p["usage"]
        return (
            "message_delta",
            p["delta"]["stop_reason"],
            p["delta"]["stop_sequence"],
            u["input_tokens"],
            u["output_tokens"],
        )
    if name == "message_stop":
        return ("message_stop",)
    if name == "error":
        return ("error", p["error"]["type"], p["error"]["message"])
    if name == "ping":
        assert p == {"type": "ping"}
        return ("ping",)
    raise AssertionError(name)


BEGIN = "begin"  # message_start before the first chunk (the response's head went out)
PING = "ping"  # a keepalive (the upstream's comment line, or hal0d's own while it waits)


def play(script: list[dict[str, Any] | str], **kw: Any) -> list[Event]:
    """Feed chunks; DONE stands for the upstream's data: [DONE] (the translator's finish()),
    BEGIN and PING for the translator's begin() and ping()."""
    translator = Translator("client-model", **kw)
    steps = {DONE: translator.finish, BEGIN: translator.begin, PING: translator.ping}
    events: list[Event] = []
    for step in script:
        events.extend(steps[step]() if isinstance(step, str) else translator.feed(step))
    return events


def assert_pings_wait_for_message_start(events: list[Event]) -> None:
    """A strict client's rule the shared check (tests/anthropic_rules.py) leaves out: it skips
    pings wherever they are."""
    names = [name for name, _ in events]
    if "ping" in names:
        assert names[0] == "message_start", names
        assert "message_stop" not in names[:-1] and "error" not in names[:-1], names


# -- the whole way: upstream bytes -> Decoder -> Translator -> frames ---------------------------


def run_pipeline(pieces: list[bytes], **options: Any) -> list[Event]:
    """What the relay does: decode reads, translate each data: frame, [DONE] or EOF finishes."""
    decoder = Decoder()
    translator = Translator("client-model", **options)
    events: list[Event] = []
    for piece in pieces:
        for sse in decoder.feed(piece):
            if translator.state is State.CLOSED or translator.state is State.FAILED:
                continue
            if sse.data == "[DONE]":
                events += translator.finish()
                continue
            try:
                events += translator.feed(orjson.loads(sse.data))
            except (orjson.JSONDecodeError, MalformedChunk) as exc:
                events += translator.fail(f"bad upstream chunk: {exc}")
    decoder.close()
    if not translator.done or translator.state is State.DONE:
        events += translator.finish()
    return events


def sdk_client(body: bytes) -> anthropic.Anthropic:
    """The anthropic SDK, every request of it answered with `body` as a 200 event stream."""
    # The SDK is imported here, where it is used: at the top it would cost every collection ~1 s.
    import anthropic

    try:
        import httpx2 as httpx
    except ModuleNotFoundError:  # the SDK built on httpx before it moved to httpx2
        import httpx  # type: ignore[no-redef,import-not-found,unused-ignore]

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body)

    return anthropic.Anthropic(
        api_key="test",
        base_url="http://hal0d.test",
        max_retries=0,
        http_client=httpx.Client(transport=httpx.MockTransport(handler)),
    )


# -- any upstream stream, for the properties that hold at any read boundaries -----------------

fragment = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=4)
segment = st.one_of(
    st.tuples(st.just("reasoning"), st.lists(fragment, min_size=1, max_size=3)),
    st.tuples(st.just("text"), st.lists(fragment, min_size=1, max_size=3)),
    st.tuples(st.just("tool"), st.lists(fragment, max_size=3)),
)


@st.composite
def upstream_streams(draw: st.DrawFn) -> tuple[bytes, list[dict[str, Any]]]:
    segments = draw(st.lists(segment, max_size=5))
    reasoning_field = draw(st.sampled_from(["reasoning_content", "reasoning"]))
    usage_mode = draw(st.sampled_from(["none", "trailing", "continuous"]))
    eol = draw(st.sampled_from([b"\n", b"\r\n", b"\r"]))
    chunks: list[dict[str, Any]] = [role()]
    expected: list[dict[str, Any]] = []
    tools = 0
    for kind, parts in segments:
        if kind == "tool":
            chunks.append(call(tools, id=f"call_{tools}", name=f"tool_{tools}"))
            tool_input = {"q": "".join(parts)} if parts else {}
            arguments = orjson.dumps(tool_input).decode() if parts else ""
            step = max(1, len(arguments) // max(1, len(parts)))
            chunks.extend(
                call(tools, arguments[i : i + step]) for i in range(0, len(arguments), step)
            )
            expected.append(
                {
                    "type": "tool_use",
                    "id": f"call_{tools}",
                    "name": f"tool_{tools}",
                    "input": tool_input,
                }
            )
            tools += 1
            continue
        for part in parts:
            chunks.append(think(part, field=reasoning_field) if kind == "reasoning" else say(part))
        key = "thinking" if kind == "reasoning" else "text"
        if expected and expected[-1]["type"] == key:
            expected[-1][key] += "".join(parts)
        else:
            expected.append({"type": key, key: "".join(parts)})
    chunks.append(finish(draw(st.sampled_from(["stop", "length", "tool_calls"]))))
    if usage_mode == "continuous":
        for n, c in enumerate(chunks):
            c["usage"] = {"prompt_tokens": 5, "completion_tokens": n}
    elif usage_mode == "trailing":
        chunks.append(usage(5, len(chunks)))
    frames = [b"data: " + orjson.dumps(c) + eol + eol for c in chunks]
    if draw(st.booleans()):
        frames.insert(draw(st.integers(0, len(frames))), b": keepalive" + eol + eol)
    raw = b"".join(frames) + b"data: [DONE]" + eol + eol
    return raw, expected
