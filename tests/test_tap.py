"""The stream tap reads every line break an event stream may end its lines with: an upstream whose
events end in CR alone or in CRLF (a CRLF cut in two by the reads, too) shows the same first
token, token count and usage as one that ends them in LF, for each stream shape the tap knows
(chat completions, the Responses API, Anthropic Messages). Each case is a playbook: the
upstream's reads in, the tap's figures out. The request's record takes the prompt and its
cached part from the tap's usage, whichever way the stream said them (llama-server's timings on
its last chunk, a usage's cached_tokens, an Anthropic message_start's cache_read_input_tokens)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import pytest

from hal0d.observability.requestinfo import RequestInfo
from hal0d.transport.tap import StreamTap

ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":null}}]}\n\n'
FINISH = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
CHAT_USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":2}}\n\n'
DONE = b"data: [DONE]\n\n"
# llama-server's last chunk when the client did not ask for usage: the finish, with its timings
# (the figures of tests/fixtures/llama-server/chat-warm.json: 903 of a 917-token prompt cached).
WARM_TIMINGS = ('"timings":{"cache_n":903,"prompt_n":14,"prompt_ms":82.155,"predicted_n":2,'
                '"predicted_ms":46.267}')
FINISH_WITH_TIMINGS = ('data: {"choices":[{"index":0,"delta":{},"finish_reason":"length"}],'
                       f'{WARM_TIMINGS}}}\n\n').encode()


def content(text: str) -> bytes:
    return ('data: {"choices":[{"index":0,'
            f'"delta":{{"content":"{text}"}},"finish_reason":null}}]}}\n\n').encode()


def named(event: str, data: str) -> bytes:
    return f"event: {event}\ndata: {data}\n\n".encode()


def text_delta(text: str) -> bytes:
    return named("content_block_delta", '{"type":"content_block_delta","index":0,'
                 f'"delta":{{"type":"text_delta","text":"{text}"}}}}')


def output_text_delta(text: str) -> bytes:
    return named("response.output_text.delta", '{"type":"response.output_text.delta",'
                 f'"item_id":"msg_1","output_index":0,"content_index":0,"delta":"{text}"}}')


@dataclass(frozen=True)
class Stream:
    name: str
    reads: tuple[bytes, ...]  # as the upstream's bytes arrive, LF-ended
    first_token_read: int  # the read that carries the first generated text
    usage: dict[str, Any]  # what the tap reports, the names as chat completions say them


STREAMS = (
    Stream(
        "chat completions",
        # The role-only opening and the first token in one read; the usage just before [DONE].
        (ROLE + content("Hel"), content("lo"), FINISH, CHAT_USAGE + DONE),
        0,
        {"prompt_tokens": 7, "completion_tokens": 2},
    ),
    Stream(
        "responses",
        (
            named("response.created", '{"type":"response.created",'
                  '"response":{"id":"resp_1","status":"in_progress"}}')
            + output_text_delta("Hel"),
            output_text_delta("lo"),
            named("response.output_text.done", '{"type":"response.output_text.done",'
                  '"item_id":"msg_1","output_index":0,"content_index":0,"text":"Hello"}')
            + named("response.completed", '{"type":"response.completed","response":'
                    '{"id":"resp_1","status":"completed",'
                    '"usage":{"input_tokens":5,"output_tokens":2,"total_tokens":7}}}'),
        ),
        0,
        {"input_tokens": 5, "output_tokens": 2, "total_tokens": 7, "prompt_tokens": 5,
         "completion_tokens": 2},
    ),
    Stream(
        "anthropic",
        (
            named("message_start", '{"type":"message_start","message":{"id":"msg_1",'
                  '"usage":{"input_tokens":5,"output_tokens":1}}}')
            + named("content_block_start", '{"type":"content_block_start","index":0,'
                    '"content_block":{"type":"text","text":""}}'),
            text_delta("Hel") + text_delta("lo"),
            named("content_block_stop", '{"type":"content_block_stop","index":0}')
            + named("message_delta", '{"type":"message_delta",'
                    '"delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":2}}')
            + named("message_stop", '{"type":"message_stop"}'),
        ),
        1,
        # message_start's input_tokens, under message_delta's totals.
        {"input_tokens": 5, "output_tokens": 2, "prompt_tokens": 5, "completion_tokens": 2},
    ),
)


def ended_by(ending: bytes) -> Callable[[tuple[bytes, ...]], list[bytes]]:
    def rewrite(reads: tuple[bytes, ...]) -> list[bytes]:
        return [read.replace(b"\n", ending) for read in reads]

    return rewrite


def crlf_cut(reads: tuple[bytes, ...]) -> list[bytes]:
    """CRLF, each read's last LF arriving at the start of the next read."""
    joined = b"".join(read.replace(b"\n", b"\r\n") for read in reads)
    edges = [0]
    for read in reads:
        edges.append(edges[-1] + len(read.replace(b"\n", b"\r\n")))
    cuts = [0, *(edge - 1 for edge in edges[1:-1]), len(joined)]
    return [joined[start:end] for start, end in pairwise(cuts)]


def figures(reads: list[bytes] | tuple[bytes, ...]) -> dict[str, Any]:
    """What the tap shows of a stream: after which reads it had seen the first token, the
    deltas it counted, and what the record takes from it."""
    tap = StreamTap(started=0.0)
    first_seen = []
    for read in reads:
        tap.on_chunk(read)
        first_seen.append(tap.first_token_at is not None)
    return {"first_seen": first_seen, "tokens": tap.tokens, "generated": tap.generated(),
            "usage": tap.usage(), "completion_tokens": tap.completion_tokens()}


@pytest.mark.parametrize("stream", STREAMS, ids=[stream.name for stream in STREAMS])
@pytest.mark.parametrize("rewrite", [ended_by(b"\r"), ended_by(b"\r\n"), crlf_cut],
                         ids=["CR", "CRLF", "CRLF cut by the reads"])
def test_events_ended_by_cr_or_crlf_show_what_lf_ended_ones_do(
    stream: Stream, rewrite: Callable[[tuple[bytes, ...]], list[bytes]]
) -> None:
    expected = figures(stream.reads)
    assert expected["first_seen"].index(True) == stream.first_token_read
    assert expected["usage"] == stream.usage
    assert expected["completion_tokens"] == 2
    assert figures(rewrite(stream.reads)) == expected


@dataclass(frozen=True)
class CachedStream:
    name: str
    reads: tuple[bytes, ...]
    prompt_tokens: int
    cached_tokens: int


CACHED_STREAMS = (
    CachedStream(
        "chat completions, llama-server's timings on the last chunk and no usage",
        (ROLE, content("Hel"), content("lo"), FINISH_WITH_TIMINGS + DONE),
        917, 903,
    ),
    CachedStream(
        "chat completions, a usage and timings that disagree: the usage's figure",
        (ROLE + content("Hel"), content("lo"), FINISH,
         b'data: {"choices":[],"usage":{"prompt_tokens":917,"completion_tokens":2,'
         b'"prompt_tokens_details":{"cached_tokens":900}},'
         + WARM_TIMINGS.encode() + b"}\n\n" + DONE),
        917, 900,
    ),
    CachedStream(
        "anthropic as llama-server sends it: the cache in message_start only",
        (
            named("message_start", '{"type":"message_start","message":{"id":"msg_1","usage":'
                  '{"cache_read_input_tokens":903,"input_tokens":14,"output_tokens":0}}}')
            + named("content_block_start", '{"type":"content_block_start","index":0,'
                    '"content_block":{"type":"text","text":""}}')
            + text_delta("Hel"),
            text_delta("lo"),
            named("content_block_stop", '{"type":"content_block_stop","index":0}')
            + named("message_delta", '{"type":"message_delta",'
                    '"delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":2}}')
            + named("message_stop", '{"type":"message_stop"}'),
        ),
        917, 903,
    ),
    CachedStream(
        "responses, the cached part in input_tokens_details",
        (
            output_text_delta("Hel"),
            output_text_delta("lo")
            + named("response.completed", '{"type":"response.completed","response":'
                    '{"id":"resp_1","status":"completed","usage":{"input_tokens":917,'
                    '"input_tokens_details":{"cached_tokens":903},"output_tokens":2}}}'),
        ),
        917, 903,
    ),
)


@pytest.mark.parametrize("stream", CACHED_STREAMS, ids=[stream.name for stream in CACHED_STREAMS])
@pytest.mark.parametrize("rewrite", [ended_by(b"\n"), ended_by(b"\r"), crlf_cut],
                         ids=["LF", "CR", "CRLF cut by the reads"])
def test_the_record_takes_the_prompt_and_its_cached_part_however_the_stream_said_them(
    stream: CachedStream, rewrite: Callable[[tuple[bytes, ...]], list[bytes]]
) -> None:
    tap = StreamTap(started=0.0)
    for read in rewrite(stream.reads):
        tap.on_chunk(read)
    info = RequestInfo(request_id="r", endpoint="/v1/chat/completions")
    info.apply_usage(tap.usage())  # as the forward path records a stream
    assert (info.prompt_tokens, info.cached_tokens) == (stream.prompt_tokens,
                                                        stream.cached_tokens)
    assert tap.completion_tokens() == 2
