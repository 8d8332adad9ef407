"""The Ollama transform of the relay: upstream SSE bytes in, Ollama NDJSON lines out (pure).

sse.Decoder splits the byte stream into events, Translator turns each chunk into Ollama objects,
one JSON object a line. `data: [DONE]` is consumed here. A malformed chunk, an upstream that
breaks or ends without a finish_reason: one `{"error": ...}` line ends the stream.
"""

from __future__ import annotations

from typing import Any

from hal0d.errors import ErrorCode
from hal0d.ollama.stream import Incomplete, MalformedChunk, Translator, encode, error_line
from hal0d.protocol.chat_chunk import Unreadable, chunk_of
from hal0d.protocol.sse import Decoder
from hal0d.protocol.transform import StallTrip, TransformFailed


class OllamaTransform:
    def __init__(self, translator: Translator) -> None:
        self.translator = translator
        self.decoder = Decoder()
        self._ended = False  # the error line or the last object was written

    def _failed(self, done: list[dict[str, Any]], error_code: str,
                message: str) -> TransformFailed:
        """What the good objects of this read became, then the error line."""
        self._ended = True
        return TransformFailed(error_code, encode(done) + error_line(message))

    def start(self) -> bytes:
        return b""

    def feed(self, chunk: bytes) -> bytes:
        translator = self.translator
        out: list[dict[str, Any]] = []
        try:
            for event in self.decoder.feed(chunk):
                if translator.done:
                    break
                parsed = chunk_of(event)
                out += translator.finish() if parsed is None else translator.feed(parsed)
        except Unreadable as exc:
            raise self._failed(out, ErrorCode.UPSTREAM_MALFORMED, str(exc)) from None
        except Incomplete as exc:
            raise self._failed(out, ErrorCode.UPSTREAM_INCOMPLETE, str(exc)) from None
        except MalformedChunk as exc:
            raise self._failed(out, ErrorCode.UPSTREAM_MALFORMED, str(exc)) from None
        return encode(out) if out else b""

    def end(self) -> bytes:
        self.decoder.close()
        if self.translator.done:
            return b""
        try:
            return encode(self.translator.finish())
        except Incomplete as exc:
            raise self._failed([], ErrorCode.UPSTREAM_INCOMPLETE, str(exc)) from None

    def stalled(self, trip: StallTrip) -> bytes:
        if self._ended:
            return b""
        self._ended = True
        return encode(self.translator.stalled(trip))

    def broken(self, message: str) -> bytes:
        if self.translator.done or self._ended:
            return b""
        self._ended = True
        return error_line(message)

    def complete(self) -> bool:
        return self.translator.done
