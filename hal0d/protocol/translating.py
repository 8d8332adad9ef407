"""The skeleton of a translating transform: upstream chat-completion SSE bytes in, a surface's own
frames out (pure).

Three surfaces translate the stream an OpenAI-style upstream sends (hal0d/anthropic/transform.py,
hal0d/ollama/transform.py, the Responses bridge in hal0d/openai/responses_bridge.py); the way a
stream is read and ended is the same for all of them, and written here once:

    each read ──sse.Decoder──► events ──chunk_of──► a chunk ──translator.feed──► items
                                          └─ [DONE] ──finish──► the items that end the answer
    translator done                        the rest of the stream is not read (trailing usage
                                           chunks and [DONE] change nothing)
    unreadable or malformed chunk,         TransformFailed, its frame what the good events of
      [DONE] without a finish_reason         the same read became, then the failure: nothing
                                             is lost
    end of the body                        the finish, unless a terminal frame is out
    stall trip, broken upstream            the surface's stall or failure frame, once
    a comment line (the upstream's         the surface's own keepalive, in its place among the
      keepalive, llama-server's `:`)         frames of the same read (none once the answer is
                                             done)

The forward path asks for the same keepalive (`keepalive()`) while the request waits for its
queue, its load or its first token, since the client's idle timeout does not know why nothing
comes.

A surface fills in only what is its own (Translating's hooks): `finish` (raising Unfinished when
the upstream gave no finish_reason), `failure`, `stall`, `ping` (its keepalive), `encode`, and
the words before a malformed chunk's message. Pure: neither asyncio nor aiohttp
(tests/test_purity.py, through the surfaces' transforms).
"""

from __future__ import annotations

from typing import Any, Generic, Protocol, TypeVar

from hal0d.errors import ErrorCode
from hal0d.protocol.chat_chunk import MalformedChunk, Unreadable, chunk_of
from hal0d.protocol.sse import COMMENT, Decoder, Event
from hal0d.protocol.transform import StallTrip, TransformFailed

__all__ = ["ChunkTranslator", "Translating", "Unfinished"]

Item = TypeVar("Item")


class ChunkTranslator(Protocol[Item]):
    """A surface's sans-I/O translator: parsed chat-completion chunks in, its own items out."""

    @property
    def done(self) -> bool:
        """Its terminal item is out: nothing more it says can reach the client."""
        ...

    def feed(self, chunk: Any) -> list[Item]:
        """One parsed chunk's items; MalformedChunk when it cannot be translated."""
        ...


class Unfinished(Exception):
    """Translating.finish's way of saying the upstream ended without a finish_reason; `items`
    are the surface's failure items, which follow the good ones of the same read."""

    def __init__(self, items: list[Any]) -> None:
        super().__init__("the upstream ended the stream without a finish_reason")
        self.items = items


class Translating(Generic[Item]):
    """The relay's Transform for a translating surface, less the surface's own hooks.

    The per-read loop calls the translator's `feed` and `done` directly and the surface's
    encoder (bound as a staticmethod) once, as a hand-written transform would: it runs for every
    relayed chunk of every translated stream. A terminal frame (the finish at the end of the
    body, a failure, a stall, a break) is rendered once; after it, the others are b"".
    """

    __slots__ = ("_ended", "_translator", "decoder")

    # Put before a MalformedChunk's own words in the failure the client reads.
    malformed_prefix = "upstream sent a malformed chunk: "

    def __init__(self, translator: ChunkTranslator[Item]) -> None:
        self._translator = translator
        self.decoder = Decoder(comments=True)
        self._ended = False

    # What each surface fills in.

    def finish(self) -> list[Item]:
        """The upstream said it is done ([DONE] or the end of the body): the items that end the
        answer. Raises Unfinished with the failure's items when no finish_reason came."""
        raise NotImplementedError

    def failure(self, message: str, error_code: str) -> list[Item]:
        """The items that end the stream failed, saying `message`."""
        raise NotImplementedError

    def stall(self, trip: StallTrip) -> list[Item]:
        """The items that end a stream the stall guard cut."""
        raise NotImplementedError

    def ping(self, what: str | None) -> bytes:
        """The surface's keepalive frame, one that a client reads as nothing: what a waiting
        request (`what` says for what, where the surface has room for words) or an upstream's
        comment line becomes."""
        raise NotImplementedError

    @staticmethod
    def encode(items: list[Item], /) -> bytes:
        """The items as the bytes the client reads (a staticmethod: no call in between)."""
        raise NotImplementedError

    # The Transform (hal0d/protocol/transform.py).

    def start(self) -> bytes:
        return b""  # the first frame waits for the first chunk, which may carry the prompt's usage

    def feed(self, chunk: bytes) -> bytes:
        decoder = self.decoder
        events = decoder.feed(chunk)
        if decoder.comments:
            return self._kept_alive(events)
        return self._translate(events)

    def keepalive(self, what: str | None = None) -> bytes:
        """The surface's keepalive (`ping`), to send while the answer waits; b"" once the
        stream's terminal frame is out."""
        if self._ended or self._translator.done:
            return b""
        return self.ping(what)

    def _kept_alive(self, events: list[Event]) -> bytes:
        """A read that held comment lines: each comment the surface's keepalive, in its place
        among the frames of the events around it. A failure's frame keeps what came before it."""
        out: list[bytes] = []
        start = 0
        try:
            for at, event in enumerate(events):
                if event is COMMENT:
                    out.append(self._translate(events[start:at]))
                    out.append(self.keepalive())
                    start = at + 1
            out.append(self._translate(events[start:]))
        except TransformFailed as exc:
            raise TransformFailed(exc.error_code, b"".join(out) + exc.frame) from None
        return b"".join(out)

    def _translate(self, events: list[Event]) -> bytes:
        translator = self._translator
        items: list[Item] = []
        try:
            for event in events:
                if translator.done:
                    break
                parsed = chunk_of(event)
                items += self.finish() if parsed is None else translator.feed(parsed)
        except Unfinished as exc:
            raise self._ending(ErrorCode.UPSTREAM_INCOMPLETE, items + exc.items) from None
        except Unreadable as exc:
            raise self._failed(items, ErrorCode.UPSTREAM_MALFORMED, str(exc)) from None
        except MalformedChunk as exc:
            raise self._failed(items, ErrorCode.UPSTREAM_MALFORMED,
                               f"{self.malformed_prefix}{exc}") from None
        return self.encode(items) if items else b""

    def end(self) -> bytes:
        self.decoder.close()
        if self._ended or self._translator.done:
            return b""
        try:
            items = self.finish()
        except Unfinished as exc:
            raise self._ending(ErrorCode.UPSTREAM_INCOMPLETE, exc.items) from None
        self._ended = True
        return self.encode(items)

    def stalled(self, trip: StallTrip) -> bytes:
        if self._ended or self._translator.done:
            return b""
        self._ended = True
        return self.encode(self.stall(trip))

    def broken(self, message: str) -> bytes:
        if self._ended or self._translator.done:
            return b""
        self._ended = True
        return self.encode(self.failure(message, ErrorCode.UPSTREAM_BROKEN))

    def complete(self) -> bool:
        return self._translator.done

    def _failed(self, done: list[Item], error_code: str, message: str) -> TransformFailed:
        return self._ending(error_code, done + self.failure(message, error_code))

    def _ending(self, error_code: str, items: list[Item]) -> TransformFailed:
        self._ended = True
        return TransformFailed(error_code, self.encode(items))
