"""The Anthropic transform of the relay: upstream SSE bytes in, Anthropic SSE frames out (pure).

The skeleton every translating surface shares (hal0d/protocol/translating.py) reads the stream;
the Translator turns each OpenAI chunk into Anthropic events and encode_events frames them. A
failure is the translator's one `error` event, never a message_stop. Pure like the rest of the
package: it imports neither asyncio nor aiohttp (tests/test_purity.py).

What the forward path may send before the upstream's first byte: `opening()` (message_start with
the response's head), `keepalive()` (a ping, message_start first if it is not out) and `failed()`
(the error event, when the request fails after the head).
"""

from __future__ import annotations

import orjson

from hal0d.anthropic.stream import Event, State, Translator, encode_events
from hal0d.protocol.transform import STALL_KEY, StallTrip
from hal0d.protocol.translating import Translating, Unfinished


class AnthropicTransform(Translating[Event]):
    __slots__ = ("translator",)

    encode = staticmethod(encode_events)

    def __init__(self, translator: Translator) -> None:
        super().__init__(translator)
        self.translator = translator

    def opening(self, input_tokens: int | None = None) -> bytes:
        """message_start, once (b"" when it is out): `input_tokens` as the translator's begin()
        takes it."""
        if self.translator.state is not State.IDLE:
            return b""
        return encode_events(self.translator.begin(input_tokens))

    def failed(self, message: str, error_type: str = "api_error") -> bytes:
        """The `error` event (Anthropic's error envelope, `error_type` its error.type) after
        whatever is out, for a request that fails before the upstream's first byte; b"" when the
        stream has ended."""
        if self._ended or self.translator.done:
            return b""
        self._ended = True
        return encode_events(self.translator.fail(message, error_type=error_type))

    def ping(self, what: str | None) -> bytes:
        return encode_events(self.translator.ping())  # `{"type": "ping"}` has no room for words

    def finish(self) -> list[Event]:
        events = self.translator.finish()
        if self.translator.stop_reason is None:
            raise Unfinished(events)  # the translator's own error event, after message_start
        return events

    def failure(self, message: str, error_code: str) -> list[Event]:
        return self.translator.fail(message)

    def stall(self, trip: StallTrip) -> list[Event]:
        details = orjson.dumps({STALL_KEY: trip.details()}).decode()
        return self.translator.fail(f"{trip.notice()} {details}")
