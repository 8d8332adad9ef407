"""The Responses transform as a playbook: upstream bytes in, the same bytes out, and hal0d's own
endings as Responses events that continue the upstream's (same id, next sequence numbers)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from hal0d.openai.responses import ResponsesTransform
from hal0d.openai.transform import Passthrough
from hal0d.protocol.transform import StallTrip, TransformFailed

TRIP = StallTrip(reason="idle", elapsed_s=1.2, upstream="llm", total_s=30.0, idle_s=0.5)


def event(kind: str, sequence: int, **fields: Any) -> bytes:
    payload = {"type": kind, "sequence_number": sequence, **fields}
    return f"event: {kind}\ndata: ".encode() + orjson.dumps(payload) + b"\n\n"


OPENING = (
    event("response.created", 0, response={"id": "resp_1", "model": "m", "status": "in_progress"})
    + event("response.output_item.added", 1, output_index=0,
            item={"id": "msg_1", "type": "message", "content": []})
    + event("response.content_part.added", 2, item_id="msg_1", output_index=0, content_index=0,
            part={"type": "output_text", "text": ""})
    + event("response.output_text.delta", 3, item_id="msg_1", output_index=0, content_index=0,
            delta="Hel")
)


def events_of(frames: bytes) -> list[dict[str, Any]]:
    return [orjson.loads(line[6:]) for line in frames.split(b"\n") if line.startswith(b"data: ")]


@pytest.mark.parametrize("split", [1, 7, 50, len(OPENING)])
def test_stall_adds_the_notice_to_the_open_part_then_incomplete_at_any_split(split: int) -> None:
    transform = ResponsesTransform(model="m")
    out = b"".join(transform.feed(OPENING[at:at + split]) for at in range(0, len(OPENING), split))
    assert out == OPENING
    ending = events_of(transform.stalled(TRIP))
    assert [e["type"] for e in ending] == ["response.output_text.delta", "response.incomplete"]
    assert ending[0]["item_id"] == "msg_1" and ending[0]["content_index"] == 0
    assert "[hal0] stall guard" in ending[0]["delta"]
    assert [e["sequence_number"] for e in ending] == [4, 5]
    incomplete = ending[1]["response"]
    assert incomplete["id"] == "resp_1" and incomplete["status"] == "incomplete"
    assert incomplete["incomplete_details"] == {"reason": "max_output_tokens"}
    assert incomplete["x_hal0_stall"]["reason"] == "idle"


def test_stall_before_anything_opens_the_response_item_and_part_itself() -> None:
    ending = events_of(ResponsesTransform(model="m").stalled(TRIP))
    assert [e["type"] for e in ending] == [
        "response.created", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.incomplete"]
    assert ending[0]["response"]["id"] == ending[-1]["response"]["id"]


def test_break_is_an_error_event_the_sdk_raises_on_then_response_failed() -> None:
    transform = ResponsesTransform(model="m")
    transform.feed(OPENING)
    ending = events_of(transform.broken("upstream 'llm' broke the stream"))
    assert [e["type"] for e in ending] == ["error", "response.failed"]
    assert ending[0]["error"]["message"] == "upstream 'llm' broke the stream"
    assert ending[1]["response"]["status"] == "failed"


def test_an_end_without_a_terminal_event_fails_and_after_completed_nothing_is_added() -> None:
    transform = ResponsesTransform(model="m")
    transform.feed(OPENING)
    with pytest.raises(TransformFailed) as failed:
        transform.end()
    assert failed.value.error_code == "upstream_incomplete"
    assert b"response.failed" in failed.value.frame

    done = ResponsesTransform(model="m")
    done.feed(OPENING + event("response.completed", 4, response={"id": "resp_1"}))
    assert done.end() == b"" and done.stalled(TRIP) == b"" and done.broken("x") == b""


def test_a_keepalive_is_one_comment_line_naming_the_wait_until_a_terminal_event() -> None:
    transform = ResponsesTransform(model="m")
    assert transform.keepalive("loading m, 12 s\n(last load took 41 s)") == (
        b": hal0d: loading m, 12 s (last load took 41 s)\n\n")
    assert transform.feed(b":\n\n" + OPENING) == b":\n\n" + OPENING  # the upstream's, as it came
    transform.feed(event("response.completed", 4, response={"id": "resp_1"}))
    assert transform.keepalive("prefill") == b""


@pytest.mark.parametrize("legacy", [False, True], ids=["chat", "completions"])
def test_the_passthrough_keepalive_is_one_comment_line_and_nothing_for_a_body_not_sse(
    legacy: bool,
) -> None:
    sse = Passthrough(sse=True, legacy_completion=legacy, model="m", expect_done=True)
    assert sse.keepalive("queued, 3 ahead") == b": hal0d: queued, 3 ahead\n\n"
    assert sse.keepalive("a\r\nb") == b": hal0d: a b\n\n"
    assert sse.feed(b":\n\n") == b":\n\n"  # the upstream's own comments pass as they came
    other = Passthrough(sse=False, legacy_completion=legacy, model="m", expect_done=False)
    assert other.keepalive("loading") == b""
