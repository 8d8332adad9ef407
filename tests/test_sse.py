"""The SSE decoder and encoder: line breaks, split reads, UTF-8, huge lines, comment lines, the
real captures."""

from __future__ import annotations

import itertools
import re

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hal0d.protocol.sse import COMMENT, Decoder, Event, comment, encode
from tests.fixtures_util import fixture_path


def feed_all(pieces: list[bytes], *, comments: bool = False) -> list[Event]:
    decoder = Decoder(comments=comments)
    events: list[Event] = []
    for piece in pieces:
        events.extend(decoder.feed(piece))
    events.extend(decoder.close())
    return events


def feed_split(data: bytes, cuts: list[int], *, comments: bool = False) -> list[Event]:
    bounds = [0, *sorted(cuts), len(data)]
    return feed_all([data[a:b] for a, b in itertools.pairwise(bounds)], comments=comments)


def reference_decode(data: bytes, *, comments: bool = False) -> list[Event]:
    """The WHATWG algorithm written the obvious way, over the whole stream at once."""
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    lines = re.split(rb"\r\n|\r|\n", data)[:-1]
    events: list[Event] = []
    buffer: list[str] = []
    event_type = ""
    last_id: str | None = None
    for raw in lines:
        line = raw.decode("utf-8", "replace")
        if line == "":
            if buffer:
                events.append(Event(event_type or None, "\n".join(buffer), last_id))
            buffer, event_type = [], ""
            continue
        if line.startswith(":"):
            if comments:
                events.append(COMMENT)
            continue
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            buffer.append(value)
        elif name == "event":
            event_type = value
        elif name == "id" and "\x00" not in value:
            last_id = value
    return events


@pytest.mark.parametrize(
    ("stream", "expected"),
    [
        pytest.param(b"data: a\n\n", [Event(None, "a")], id="LF"),
        pytest.param(b"data: a\r\n\r\n", [Event(None, "a")], id="CRLF"),
        pytest.param(b"data: a\r\r", [Event(None, "a")], id="CR"),
        pytest.param(
            b"data: a\r\n\ndata: b\r\rdata: c\n\r\n",
            [Event(None, "a"), Event(None, "b"), Event(None, "c")],
            id="mixed",
        ),
        pytest.param(
            b"data: a\ndata: b\n\n", [Event(None, "a\nb")], id="multi-line data joined with LF"
        ),
        pytest.param(
            b": keepalive\ndata: a\n: more\n\n", [Event(None, "a")], id="comments ignored"
        ),
        pytest.param(b":\n\n", [], id="comment-only event not dispatched"),
        pytest.param(b"event: ping\n\n", [], id="event without data not dispatched"),
        pytest.param(b"data\n\n", [Event(None, "")], id="field without colon has empty value"),
        pytest.param(b"data:\n\n", [Event(None, "")], id="empty data dispatched"),
        pytest.param(b"data:a\n\n", [Event(None, "a")], id="no space after colon"),
        pytest.param(b"data:  a \n\n", [Event(None, " a ")], id="only one leading space stripped"),
        pytest.param(b"data: a:b: c\n\n", [Event(None, "a:b: c")], id="later colons kept"),
        pytest.param(
            b"event: message_start\ndata: {}\n\n", [Event("message_start", "{}")], id="named event"
        ),
        pytest.param(
            b"event: x\n\ndata: a\n\n", [Event(None, "a")], id="event name reset by blank line"
        ),
        pytest.param(
            b"id: 7\ndata: a\n\ndata: b\n\n",
            [Event(None, "a", "7"), Event(None, "b", "7")],
            id="last id carries over",
        ),
        pytest.param(
            b"id: 7\ndata: a\n\nid: 8\x00\ndata: b\n\n",
            [Event(None, "a", "7"), Event(None, "b", "7")],
            id="id with NUL ignored",
        ),
        pytest.param(
            b"retry: 10\nfoo: bar\ndata: a\n\n",
            [Event(None, "a")],
            id="retry and unknown fields ignored",
        ),
        pytest.param(b"\xef\xbb\xbfdata: a\n\n", [Event(None, "a")], id="leading BOM stripped"),
        pytest.param(
            b"data: a\xe2\x80\xa8b\x85\x0b\x0c\x1c\n\n",
            [Event(None, "a\u2028b\ufffd\x0b\x0c\x1c")],
            id="only CR and LF break lines",
        ),
        pytest.param(
            b"data: a\n\ndata: incomplete\n",
            [Event(None, "a")],
            id="event without blank line dropped at close",
        ),
        pytest.param(
            b"data: a\n\ndata: no newline",
            [Event(None, "a")],
            id="unterminated line dropped at close",
        ),
    ],
)
def test_decoder_playbook(stream: bytes, expected: list[Event]) -> None:
    assert feed_all([stream]) == expected
    assert feed_all([bytes([b]) for b in stream]) == expected
    assert reference_decode(stream) == expected


def test_crlf_split_across_feeds_is_one_line_break() -> None:
    decoder = Decoder()
    assert decoder.feed(b"data: a\r") == []
    # If the LF opening this read were a second line break, "a" would dispatch alone.
    assert decoder.feed(b"\ndata: b\r") == []
    assert decoder.feed(b"\n") == []
    assert decoder.feed(b"\r\n") == [Event(None, "a\nb")]


def test_lone_cr_then_data_is_a_line_break() -> None:
    decoder = Decoder()
    assert decoder.feed(b"data: a\r") == []
    assert decoder.feed(b"\r") == [Event(None, "a")]


def test_cr_pending_survives_empty_feed() -> None:
    decoder = Decoder()
    assert decoder.feed(b"data: a\r") == []
    assert decoder.feed(b"") == []
    assert decoder.feed(b"\n") == []
    assert decoder.feed(b"\n") == [Event(None, "a")]


@pytest.mark.parametrize("text", ["é", "€", "😀", "naïve – 日本語 🎉"])
def test_utf8_split_at_every_byte(text: str) -> None:
    stream = f"event: tëst\ndata: {text}\n\n".encode()
    for cut in range(len(stream) + 1):
        assert feed_all([stream[:cut], stream[cut:]]) == [Event("tëst", text)], cut


def test_invalid_utf8_is_replaced_and_marked_on_its_own_event_only() -> None:
    events = feed_all([b"data: ok\n\ndata: a\xffb\n\ndata: fine\n\n"])
    assert [e.data for e in events] == ["ok", "a\ufffdb", "fine"]
    assert [e.invalid_utf8 for e in events] == [False, True, False]


def test_two_mib_data_line() -> None:
    payload = b"x" * (2 * 1024 * 1024)
    stream = b"data: " + payload + b"\n\n"
    assert feed_all([stream]) == [Event(None, payload.decode())]
    step = len(stream) // 1000 + 1
    pieces = [stream[i : i + step] for i in range(0, len(stream), step)]
    assert len(pieces) >= 900
    assert feed_all(pieces) == [Event(None, payload.decode())]


def test_close_discards_and_resets() -> None:
    decoder = Decoder()
    assert decoder.feed(b"event: x\ndata: half") == []
    assert decoder.close() == []
    assert decoder.feed(b"data: fresh\n\n") == [Event(None, "fresh")]


def test_llama_cpp_python_capture_decodes() -> None:
    raw = fixture_path("llama-cpp-python-0.3.36-smollm2-stream.sse").read_bytes()
    events = feed_all([raw])
    assert len(events) == 14
    assert all(event.event is None for event in events)
    assert events[-1].data == "[DONE]"
    chunks = [orjson.loads(event.data) for event in events[:-1]]
    assert len(chunks) == 13
    assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk"}
    assert [feed_split(raw, [cut]) for cut in range(0, len(raw), 97)] == [events] * len(
        range(0, len(raw), 97)
    )


def test_encode_frame() -> None:
    assert encode("message_stop", b'{"type":"message_stop"}') == (
        b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    )
    assert feed_all([encode("ping", b"{}")]) == [Event("ping", "{}")]


_PIECES = [
    b"data:",
    b"data: ",
    b"event: ",
    b"id: ",
    b"id",
    b"retry: 5",
    b":",
    b" ",
    b"x",
    b"yz",
    b"{}",
    b"\n",
    b"\r",
    b"\r\n",
    b"\n\n",
    b"\r\n\r\n",
    "é".encode(),
    "😀".encode(),
    b"\xff",
    b"\x00",
    b"\xef\xbb\xbf",
]
streams = st.lists(st.sampled_from(_PIECES), max_size=60).map(b"".join) | st.binary(max_size=200)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), stream=streams)
def test_any_split_decodes_like_the_whole_stream(data: st.DataObject, stream: bytes) -> None:
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=12))
    whole = feed_all([stream])
    assert feed_split(stream, cuts) == whole
    assert whole == reference_decode(stream)


def kinds(events: list[Event]) -> list[Event | str]:
    return ["COMMENT" if event is COMMENT else event for event in events]


@settings(max_examples=300, deadline=None)
@given(data=st.data(), stream=streams)
def test_any_split_reports_comments_in_the_same_places(data: st.DataObject, stream: bytes) -> None:
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=12))
    whole = feed_all([stream], comments=True)
    assert kinds(feed_split(stream, cuts, comments=True)) == kinds(whole)
    assert kinds(whole) == kinds(reference_decode(stream, comments=True))
    assert [event for event in whole if event is not COMMENT] == feed_all([stream])


# --- comment lines: counted always, dispatched when asked, in their places ---------------------


@pytest.mark.parametrize(
    ("stream", "expected"),
    [
        pytest.param(b":\n\n", ["COMMENT"], id="colon alone (llama-server)"),
        pytest.param(b": ping\r\n\r\n", ["COMMENT"], id="named, CRLF"),
        pytest.param(
            b":\n\ndata: a\n\n: ping\n\ndata: b\n\n",
            ["COMMENT", Event(None, "a"), "COMMENT", Event(None, "b")],
            id="between events",
        ),
        pytest.param(
            b"data: a\n: inside\ndata: b\n\n",
            ["COMMENT", Event(None, "a\nb")],
            id="inside an event: before it, the event whole",
        ),
        pytest.param(b"data: :\n\n", [Event(None, ":")], id="a colon in a value is no comment"),
    ],
)
def test_comment_playbook(stream: bytes, expected: list[Event | str]) -> None:
    assert kinds(feed_all([stream], comments=True)) == expected
    assert kinds(feed_all([bytes([b]) for b in stream], comments=True)) == expected
    assert kinds(reference_decode(stream, comments=True)) == expected
    assert feed_all([stream]) == [e for e in expected if e != "COMMENT"]  # the default drops them


def test_comments_counts_the_comment_lines_of_the_last_feed_only() -> None:
    for decoder in (Decoder(), Decoder(comments=True)):
        assert decoder.comments == 0
        decoder.feed(b": one\n:\n\ndata: a\n")
        assert decoder.comments == 2
        decoder.feed(b"\n")
        assert decoder.comments == 0
        decoder.feed(b":")  # not a line until its break comes
        assert decoder.comments == 0
        decoder.feed(b" cut\r")
        assert decoder.comments == 1
        decoder.close()
        assert decoder.comments == 0


def test_comment_is_one_comment_line_that_decodes_to_nothing() -> None:
    assert comment("ping") == b": ping\n\n"
    assert comment("") == b":\n\n"
    assert comment("hal0d: loading q, 12 s\r\n(last took 41 s)\rnow\n") == (
        b": hal0d: loading q, 12 s (last took 41 s) now \n\n")
    assert comment("naïve") == ": naïve\n\n".encode()
    for text in ("ping", "a\nb\r\nc\rd", "", "\n"):
        frame = comment(text)
        assert frame.count(b"\n") == 2 and b"\r" not in frame
        assert kinds(feed_all([frame], comments=True)) == ["COMMENT"]
        assert feed_all([frame + b"data: x\n\n"]) == [Event(None, "x")]


def test_llama_server_prefill_capture_comments_come_before_the_chunks() -> None:
    from tests.llama_server_capture import PREFILL_PINGS, read_capture

    capture = read_capture(PREFILL_PINGS)
    decoder = Decoder(comments=True)
    counts = []
    events: list[Event] = []
    for chunk in capture.chunks:
        events += decoder.feed(chunk)
        counts.append(decoder.comments)
    assert counts == [1, 1, 1, 0, 0, 0, 0, 0, 0]
    assert kinds(events[:3]) == ["COMMENT"] * 3
    assert "COMMENT" not in kinds(events[3:]) and events[-1].data == "[DONE]"
