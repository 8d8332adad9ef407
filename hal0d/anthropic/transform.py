"""The Anthropic transform of the relay: upstream SSE bytes in, Anthropic SSE frames out (pure).

The skeleton every translating surface shares (hal0d/protocol/translating.py) reads the stream;
the Translator turns each OpenAI chunk into Anthropic events and encode_events frames them. A
failure is the translator's one `error` event, never a message_stop. Pure like the rest of the
package: it imports neither asyncio nor aiohttp (tests/test_purity.py).
"""

from __future__ import annotations

import orjson

from hal0d.anthropic.stream import Event, Translator, encode_events
from hal0d.protocol.transform import STALL_KEY, StallTrip
from hal0d.protocol.translating import Translating, Unfinished


class AnthropicTransform(Translating[Event]):
    __slots__ = ("translator",)

    encode = staticmethod(encode_events)

    def __init__(self, translator: Translator) -> None:
        super().__init__(translator)
        self.translator = translator

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
