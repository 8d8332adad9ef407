"""The Ollama transform of the relay: upstream SSE bytes in, Ollama NDJSON lines out (pure).

The skeleton every translating surface shares (hal0d/protocol/translating.py) reads the stream;
the Translator turns each chunk into Ollama objects, one JSON object a line. A malformed chunk,
an upstream that breaks or ends without a finish_reason: a piece of content saying so, then one
`{"error": ...}` line, end the stream; a stall trip, a last `done` object with the notice. A
keepalive is an object with empty content, not done.
"""

from __future__ import annotations

from typing import Any

from hal0d.errors import ErrorCode
from hal0d.ollama.stream import Incomplete, Translator, error_object
from hal0d.ollama.stream import encode as encode_objects
from hal0d.protocol.transform import StallTrip
from hal0d.protocol.translating import Translating, Unfinished


class OllamaTransform(Translating[dict[str, Any]]):
    __slots__ = ("translator",)

    encode = staticmethod(encode_objects)
    malformed_prefix = ""  # the error line has the chunk reader's words alone (they say upstream)

    def __init__(self, translator: Translator) -> None:
        super().__init__(translator)
        self.translator = translator

    def finish(self) -> list[dict[str, Any]]:
        try:
            return self.translator.finish()
        except Incomplete as exc:
            raise Unfinished(self.failure(str(exc), ErrorCode.UPSTREAM_INCOMPLETE)) from None

    def failure(self, message: str, error_code: str) -> list[dict[str, Any]]:
        return [self.translator.notice(message), error_object(message)]

    def stall(self, trip: StallTrip) -> list[dict[str, Any]]:
        return self.translator.stalled(trip)

    def ping(self, what: str | None) -> bytes:
        return encode_objects([self.translator.keepalive()])  # no field a client would show
