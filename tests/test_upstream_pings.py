"""llama-server's keepalives while it reads a long prompt reach the client in the client's own
form, as playbooks: the captured body (tests/fixtures/llama-server/stream-prefill-pings) in,
each translating surface's frames out, the same however the reads cut it (pure: no sockets).

    upstream (llama-server)   Anthropic               Responses bridge     Ollama
    `:` x3, once a second     message_start, ping x3  `: ping` x3          x3 content "", not done
    role chunk, 4 tokens      a text block            created, a message   4 objects
    finish length, usage      message_delta, stop     response.incomplete  done, length
"""

from __future__ import annotations

import itertools
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hal0d.anthropic.stream import Translator
from hal0d.anthropic.transform import AnthropicTransform
from hal0d.ollama.stream import Clocks
from hal0d.ollama.stream import Translator as OllamaTranslator
from hal0d.ollama.transform import OllamaTransform
from hal0d.openai.responses_bridge import Bridge, BridgeTransform
from hal0d.openai.responses_request import chat_request
from hal0d.protocol.sse import COMMENT, Decoder
from hal0d.protocol.translating import Translating
from tests.anthropic_rules import assemble, assert_valid_anthropic_stream, events_from_sse
from tests.llama_server_capture import (
    PREFILL_COMPLETION_TOKENS,
    PREFILL_PINGS,
    PREFILL_PROMPT_TOKENS,
    PREFILL_TEXT,
    read_capture,
)

CAPTURE = read_capture(PREFILL_PINGS)
BODY = CAPTURE.body
PINGS = CAPTURE.comment_chunks


def test_the_capture_is_comment_lines_a_second_apart_then_the_answer() -> None:
    assert CAPTURE.status == 200
    assert ("Content-Type", "text/event-stream") in CAPTURE.headers
    assert PINGS == 3
    assert CAPTURE.chunks[:PINGS] == (b":\n\n",) * PINGS
    assert all(not chunk.startswith(b":") for chunk in CAPTURE.chunks[PINGS:])
    assert CAPTURE.times[PINGS] - CAPTURE.times[0] > 4.0  # the prompt took seconds to read


def replay(transform: Translating[Any], pieces: list[bytes]) -> bytes:
    out = b"".join(transform.feed(piece) for piece in pieces) + transform.end()
    assert transform.complete()
    return out


def cut(data: bytes, cuts: list[int]) -> list[bytes]:
    bounds = [0, *sorted(cuts), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


# --- Anthropic: message_start, a ping per comment, then the answer -----------------------------


def anthropic(pieces: list[bytes], input_tokens: int | None = 12) -> list[tuple[str, Any]]:
    translator = Translator("client-model", input_tokens=input_tokens, message_id="msg_x")
    return events_from_sse(replay(AnthropicTransform(translator), pieces))


def short(events: list[tuple[str, Any]]) -> list[Any]:
    out: list[Any] = []
    for name, payload in events:
        if name == "message_start":
            out.append((name, payload["message"]["usage"]["input_tokens"]))
        elif name == "content_block_delta":
            out.append(("delta", payload["delta"]["text"]))
        elif name == "message_delta":
            usage = payload["usage"]
            out.append((name, payload["delta"]["stop_reason"], usage["input_tokens"],
                        usage["output_tokens"]))
        else:
            out.append(name)
    return out


EXPECTED_ANTHROPIC = [
    ("message_start", 12),
    "ping", "ping", "ping",
    "content_block_start",
    ("delta", "You"), ("delta", "'re"), ("delta", " ready"), ("delta", " to"),
    "content_block_stop",
    ("message_delta", "max_tokens", PREFILL_PROMPT_TOKENS, PREFILL_COMPLETION_TOKENS),
    "message_stop",
]


def test_anthropic_each_upstream_comment_is_a_ping_after_message_start_as_it_comes() -> None:
    translator = Translator("client-model", input_tokens=12, message_id="msg_x")
    transform = AnthropicTransform(translator)
    per_read = [events_from_sse(frame) if frame else []
                for frame in (transform.feed(chunk) for chunk in CAPTURE.chunks)]
    # The first comment cannot wait for the first chunk: message_start goes out with its ping.
    assert [[name for name, _ in read] for read in per_read[:PINGS]] == [
        ["message_start", "ping"], ["ping"], ["ping"]]
    assert per_read[0][1][1] == {"type": "ping"}
    assert transform.end() == b""  # message_stop came with the usage chunk
    events = [event for read in per_read for event in read]
    assert short(events) == EXPECTED_ANTHROPIC
    assert assert_valid_anthropic_stream(events) == "success"
    message = assemble(events)
    assert message["content"] == [{"type": "text", "text": PREFILL_TEXT}]
    # message_start said hal0d's count; the upstream's own, at the end, is the one that stands.
    assert message["usage"]["input_tokens"] == PREFILL_PROMPT_TOKENS


def test_anthropic_any_single_cut_of_the_capture_gives_the_same_strict_stream() -> None:
    for at in range(len(BODY) + 1):
        assert short(anthropic([BODY[:at], BODY[at:]])) == EXPECTED_ANTHROPIC, at


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(BODY)), max_size=16))
def test_anthropic_any_split_of_the_capture_gives_the_same_frames(cuts: list[int]) -> None:
    assert anthropic(cut(BODY, cuts)) == anthropic([BODY])


def test_anthropic_comments_in_one_read_with_the_chunks_stay_in_their_places() -> None:
    body = b":\n\n" + CAPTURE.chunks[PINGS] + b": ping\r\n\r\n" + b"".join(
        CAPTURE.chunks[PINGS + 1:])
    names = short(anthropic([body]))
    assert names[:4] == [("message_start", 12), "ping", "content_block_start", ("delta", "You")]
    assert names[4] == "ping"
    assert names.count("ping") == 2


def test_anthropic_a_comment_after_message_stop_sends_nothing() -> None:
    translator = Translator("client-model", input_tokens=12, message_id="msg_x")
    transform = AnthropicTransform(translator)
    out = transform.feed(BODY.removesuffix(b"data: [DONE]\n\n"))
    assert translator.done
    assert transform.feed(b":\n\n") == b""
    assert transform.keepalive() == b""
    assert events_from_sse(out)[-1][0] == "message_stop"


# --- the Responses bridge: comments as comments -----------------------------------------------


def bridge(pieces: list[bytes]) -> list[Any]:
    """The bridge's output as the client's SSE reader has it: COMMENT for a comment line, else
    (event, type); the item and response ids are made per run."""
    request = chat_request({"model": "m", "input": "hi", "stream": True}, served_model="served")
    transform = BridgeTransform(Bridge(request, "client-model", response_id="resp_x",
                                       created_at=1))
    out = replay(transform, pieces)
    assert out.count(b": ping\n\n") == PINGS
    return [event if event is COMMENT else (event.event, orjson.loads(event.data)["type"])
            for event in Decoder(comments=True).feed(out)]


def test_bridge_each_upstream_comment_is_a_comment_line_in_order() -> None:
    seen = bridge(list(CAPTURE.chunks))
    assert seen[:PINGS] == [COMMENT] * PINGS
    kinds = [kind for kind, _ in seen[PINGS:]]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds.count("response.output_text.delta") == PREFILL_COMPLETION_TOKENS
    assert kinds[-1] == "response.incomplete"  # finish_reason length, as the API says it
    assert all(event is not COMMENT for event in seen[PINGS:])


def test_bridge_any_single_cut_of_the_capture_gives_the_same_stream() -> None:
    whole = bridge([BODY])
    for at in range(len(BODY) + 1):
        assert bridge([BODY[:at], BODY[at:]]) == whole, at


# --- Ollama: an object that says nothing, not done --------------------------------------------


def ollama(pieces: list[bytes], *, chat: bool = True) -> list[dict[str, Any]]:
    clocks = Clocks(started=9.0, opened=10.0, now=lambda: 11.0, wall=lambda: 0.0)
    transform = OllamaTransform(OllamaTranslator("client-model", clocks, chat=chat, think=False))
    return [orjson.loads(line) for line in replay(transform, pieces).splitlines()]


CREATED = "1970-01-01T00:00:00.000000Z"


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "generate"])
def test_ollama_each_upstream_comment_is_an_empty_object_not_done(chat: bool) -> None:
    objects = ollama(list(CAPTURE.chunks), chat=chat)
    empty: dict[str, Any] = {"model": "client-model", "created_at": CREATED}
    if chat:
        empty["message"] = {"role": "assistant", "content": ""}
    else:
        empty["response"] = ""
    empty["done"] = False
    assert objects[:PINGS] == [empty] * PINGS
    texts = [o["message"]["content"] if chat else o["response"] for o in objects]
    assert "".join(texts) == PREFILL_TEXT
    assert texts[PINGS:] == ["You", "'re", " ready", " to", ""]
    last = objects[-1]
    assert (last["done"], last["done_reason"], last["prompt_eval_count"], last["eval_count"]) == (
        True, "length", PREFILL_PROMPT_TOKENS, PREFILL_COMPLETION_TOKENS)


def test_ollama_the_official_client_reads_the_keepalive_as_a_piece_that_shows_nothing() -> None:
    import ollama as client

    chat, generate = ollama([BODY], chat=True), ollama([BODY], chat=False)
    for obj in chat[:PINGS]:
        part = client.ChatResponse(**obj)
        assert (part.done, part.message.role, part.message.content) == (False, "assistant", "")
        assert not part.message.thinking and not part.message.tool_calls
    for obj in generate[:PINGS]:
        piece = client.GenerateResponse(**obj)
        assert (piece.done, piece.response, piece.thinking) == (False, "", None)
    assert "".join(client.ChatResponse(**o).message.content or "" for o in chat) == PREFILL_TEXT


def test_ollama_any_single_cut_of_the_capture_gives_the_same_objects() -> None:
    whole = ollama([BODY])
    for at in range(len(BODY) + 1):
        assert ollama([BODY[:at], BODY[at:]]) == whole, at
