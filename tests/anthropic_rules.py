"""The rules any Anthropic Messages event stream from hal0d must obey, as one reusable check.

Translator tests, relay tests and fuzzers import `assert_valid_anthropic_stream`. `events_from_sse`
reads our wire format back strictly (every frame exactly an event: line and a data: line), and
`assemble` folds a stream into the message a client would end up with.
"""

from __future__ import annotations

from typing import Any

import orjson

Event = tuple[str, dict[str, Any]]

BLOCK_DELTAS = {
    "thinking": {"thinking_delta", "signature_delta"},
    "text": {"text_delta"},
    "tool_use": {"input_json_delta"},
}
STOP_REASONS = {"end_turn", "max_tokens", "stop_sequence", "tool_use", "pause_turn", "refusal"}


def events_from_sse(raw: bytes) -> list[Event]:
    assert raw.endswith(b"\n\n"), f"stream does not end with a complete frame: {raw[-80:]!r}"
    events: list[Event] = []
    for frame in raw[:-2].split(b"\n\n"):
        lines = frame.split(b"\n")
        assert len(lines) == 2, f"frame is not exactly event: + data: {frame!r}"
        event_line, data_line = lines
        assert event_line.startswith(b"event: "), f"frame without an event: line: {frame!r}"
        assert data_line.startswith(b"data: "), f"frame without a data: line: {frame!r}"
        name = event_line[len(b"event: ") :].decode()
        payload = orjson.loads(data_line[len(b"data: ") :])
        events.append((name, payload))
    return events


def assert_valid_anthropic_stream(events: list[Event]) -> str:
    """Fail on any rule an Anthropic client relies on; return "success" or "error"."""
    assert events, "empty stream"
    for name, payload in events:
        assert isinstance(payload, dict), f"{name}: payload is not an object"
        assert payload.get("type") == name, f"event {name!r} carries type {payload.get('type')!r}"
    events = [event for event in events if event[0] != "ping"]

    if events[0][0] == "error":
        assert len(events) == 1, "an error before message_start must be the whole stream"
        _check_error(events[0][1])
        return "error"

    name, payload = events[0]
    assert name == "message_start", f"first event is {name!r}, not message_start"
    message = payload["message"]
    assert message["type"] == "message"
    assert message["role"] == "assistant"
    assert message["content"] == []
    assert isinstance(message["model"], str) and message["model"]
    assert isinstance(message["id"], str) and message["id"]
    assert message["stop_reason"] is None
    assert _is_count(message["usage"]["input_tokens"]), message["usage"]
    assert _is_count(message["usage"]["output_tokens"]), message["usage"]

    open_index: int | None = None
    open_type: str | None = None
    next_index = 0
    saw_delta = False
    for position, (name, payload) in enumerate(events[1:], start=1):
        last = position == len(events) - 1
        where = f"event {position} ({name})"
        if name == "error":
            _check_error(payload)
            assert last, f"{where}: events after an error"
            assert not saw_delta, f"{where}: error after message_delta"
            return "error"
        if saw_delta:
            assert name == "message_stop", f"{where}: only message_stop may follow message_delta"
        if name == "content_block_start":
            assert open_index is None, f"{where}: block {open_index} is still open"
            assert payload["index"] == next_index, (
                f"{where}: index {payload['index']}, expected {next_index}"
            )
            block = payload["content_block"]
            open_type = block["type"]
            assert open_type in BLOCK_DELTAS, f"{where}: unknown block type {open_type!r}"
            if open_type == "thinking":
                assert block["thinking"] == "" and isinstance(block["signature"], str), block
            elif open_type == "text":
                assert block["text"] == "", block
            else:
                assert isinstance(block["id"], str) and block["id"], block
                assert isinstance(block["name"], str) and block["name"], block
                assert block["input"] == {}, block
            open_index = next_index
            next_index += 1
        elif name == "content_block_delta":
            assert open_index is not None, f"{where}: delta with no open block"
            assert payload["index"] == open_index, (
                f"{where}: delta for {payload['index']}, open is {open_index}"
            )
            assert open_type is not None
            kind = payload["delta"]["type"]
            assert kind in BLOCK_DELTAS[open_type], f"{where}: {kind} inside a {open_type} block"
        elif name == "content_block_stop":
            assert open_index is not None, f"{where}: stop with no open block"
            assert payload["index"] == open_index, (
                f"{where}: stop for {payload['index']}, open is {open_index}"
            )
            open_index = open_type = None
        elif name == "message_delta":
            assert open_index is None, f"{where}: block {open_index} still open at message_delta"
            delta = payload["delta"]
            assert delta["stop_reason"] in STOP_REASONS, (
                f"{where}: stop_reason {delta['stop_reason']!r}"
            )
            if delta["stop_reason"] == "stop_sequence":
                assert isinstance(delta["stop_sequence"], str), f"{where}: stop_sequence missing"
            else:
                assert delta["stop_sequence"] is None, f"{where}: stray stop_sequence"
            assert _is_count(payload["usage"]["output_tokens"]), payload["usage"]
            assert _is_count(payload["usage"].get("input_tokens", 0)), payload["usage"]
            saw_delta = True
        elif name == "message_stop":
            assert saw_delta, f"{where}: message_stop without message_delta"
            assert last, f"{where}: events after message_stop"
            return "success"
        else:
            raise AssertionError(f"{where}: unexpected event name")
    raise AssertionError("stream ended without message_stop or error")


def assemble(events: list[Event]) -> dict[str, Any]:
    """The message a client ends up with; tool inputs are parsed from their partial_json."""
    message: dict[str, Any] = {
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "error": None,
    }
    partial: dict[int, str] = {}
    for name, payload in events:
        if name == "message_start":
            message["usage"] = dict(payload["message"]["usage"])
        elif name == "content_block_start":
            message["content"].append(dict(payload["content_block"]))
        elif name == "content_block_delta":
            block = message["content"][payload["index"]]
            delta = payload["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "input_json_delta":
                partial[payload["index"]] = (
                    partial.get(payload["index"], "") + delta["partial_json"]
                )
        elif name == "message_delta":
            message["stop_reason"] = payload["delta"]["stop_reason"]
            message["stop_sequence"] = payload["delta"]["stop_sequence"]
            message["usage"].update(payload["usage"])
        elif name == "error":
            message["error"] = payload["error"]
    for index, text in partial.items():
        message["content"][index]["input"] = orjson.loads(text) if text else {}
    return message


def _check_error(payload: dict[str, Any]) -> None:
    error = payload["error"]
    assert isinstance(error["type"], str) and error["type"], payload
    assert isinstance(error["message"], str) and error["message"], payload


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0
