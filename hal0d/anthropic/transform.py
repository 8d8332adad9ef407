"""The Anthropic transform of the relay: upstream SSE bytes in, Anthropic SSE frames out (pure).

sse.Decoder splits the byte stream into events, Translator turns each OpenAI chunk into
Anthropic events, encode_events frames them. `data: [DONE]` is consumed here, never forwarded.
Pure like the rest of the package: it imports neither asyncio nor aiohttp (tests/test_purity.py).
"""

from __future__ import annotations

import orjson

from hal0d.anthropic.stream import Event, MalformedChunk, Translator, encode_events
from hal0d.errors import ErrorCode
from hal0d.protocol.chat_chunk import Unreadable, chunk_of
from hal0d.protocol.sse import Decoder
from hal0d.protocol.transform import STALL_KEY, StallTrip, TransformFailed


class AnthropicTransform:
    def __init__(self, translator: Translator) -> None:
        self.translator = translator
        self.decoder = Decoder()

    def _failed(self, done: list[Event], error_code: str, message: str) -> TransformFailed:
        """What the good events of this read became, then the error frame: nothing is lost."""
        return TransformFailed(error_code, encode_events(done + self.translator.fail(message)))

    def start(self) -> bytes:
        return b""  # message_start waits for the first chunk, which may carry the prompt's usage

    def feed(self, chunk: bytes) -> bytes:
        translator = self.translator
        events: list[Event] = []
        try:
            for event in self.decoder.feed(chunk):
                if translator.done:
                    break  # message_stop was sent: trailing usage chunks and [DONE] change nothing
                parsed = chunk_of(event)
                events += self._finish(events) if parsed is None else translator.feed(parsed)
        except Unreadable as exc:
            raise self._failed(events, ErrorCode.UPSTREAM_MALFORMED, str(exc)) from None
        except MalformedChunk as exc:
            raise self._failed(
                events, ErrorCode.UPSTREAM_MALFORMED, f"upstream sent a malformed chunk: {exc}"
            ) from None
        return encode_events(events) if events else b""

    def _finish(self, done: list[Event] | None = None) -> list[Event]:
        """The upstream says it is done; without a finish_reason that is a failed stream."""
        events = self.translator.finish()
        if self.translator.stop_reason is None:
            frame = encode_events((done or []) + events)
            raise TransformFailed(ErrorCode.UPSTREAM_INCOMPLETE, frame)
        return events

    def complete(self) -> bool:
        return self.translator.done

    def end(self) -> bytes:
        self.decoder.close()
        if self.translator.done:
            return b""
        return encode_events(self._finish())

    def stalled(self, trip: StallTrip) -> bytes:
        if self.translator.done:
            return b""
        details = orjson.dumps({STALL_KEY: trip.details()}).decode()
        return encode_events(self.translator.fail(f"{trip.notice()} {details}"))

    def broken(self, message: str) -> bytes:
        if self.translator.done:
            return b""
        return encode_events(self.translator.fail(message))
