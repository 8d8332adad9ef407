"""Server-sent events: bytes in, events out (an incremental decoder), and the one frame encoder.

Pure in the h11 manner: no sockets, no event loop, nothing imported from asyncio or aiohttp. The
relay feeds whatever `readany()` returned; chunk boundaries are not event boundaries, so the
decoder keeps the unterminated tail of a line and the half of a CRLF that a read cut in two.

Lines end at CR, LF or CRLF and nowhere else (not at the other breaks `str.splitlines` knows), as
the WHATWG event-stream grammar says. Lines are split as bytes and decoded only once complete, so
a UTF-8 sequence cut by a read boundary decodes whole. The unterminated tail is kept as a list of
pieces and joined once when its line ends, and each fed chunk is scanned once, so a multi-MiB
data line fed in thousands of reads costs linear time.

Comment lines (a colon first: `:` alone, `: ping`) are no events, but an upstream sends them to
keep a quiet connection open (llama-server every `--sse-ping-interval` while it reads a long
prompt), and a translating surface turns each into a keepalive of its own. `comments` counts the
comment lines the last feed read, one attribute to look at, so a reader pays for comments only
when there were some; a Decoder built with `comments=True` also dispatches each as the COMMENT
sentinel, in its place among the events of that read. `comment` is the encoder of one.

`data_lines` is the same line rule for a reader that looks into single reads without keeping a
stream's state (the tap: it looks for its first token and for usage, and must cost a relayed
stream next to nothing).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["COMMENT", "Decoder", "Event", "comment", "data_lines", "encode"]

_BOM = b"\xef\xbb\xbf"
_LF = 0x0A
_CR = 0x0D
_COLON = 0x3A


def _split_lines(data: bytes) -> list[bytes]:
    """`data` cut at every CR, LF and CRLF, the breaks dropped; the last piece is what follows
    the last break (empty when `data` ends with one)."""
    if b"\r" in data:
        data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    return data.split(b"\n")


def data_lines(data: bytes) -> list[bytes]:
    """The values of the `data:` lines in `data`, undecoded, without the one space after the
    colon. Keeps no state between calls: a line cut by the edge of `data` comes out cut, or not
    at all (its `data:` was before the edge), which only a reader that can miss a line may use."""
    return [line[6:] if line[5:6] == b" " else line[5:]
            for line in _split_lines(data) if line.startswith(b"data:")]


# Not frozen: a frozen dataclass costs ~1 us per event to build, on the hot path.
@dataclass(slots=True)
class Event:
    """One dispatched event. `event` is None when the stream named none (the default "message").

    `id` is the last event ID seen so far in the stream, which the spec carries across events.
    """

    event: str | None
    data: str
    id: str | None = None
    # A field was not UTF-8 and was decoded with replacement characters: the event is corrupt.
    invalid_utf8: bool = field(default=False, compare=False)


# What a Decoder(comments=True) dispatches for a comment line; compare with `is`.
COMMENT = Event(None, "")


class Decoder:
    """Incremental event-stream decoder: `feed()` every read, `close()` at end of stream.

    `comments`: how many comment lines the last `feed()` read (see the module's docstring).
    """

    __slots__ = (
        "_bom_pending",
        "_cr_pending",
        "_data",
        "_dispatch_comments",
        "_event",
        "_invalid_utf8",
        "_last_id",
        "_tail",
        "comments",
    )

    def __init__(self, *, comments: bool = False) -> None:
        self._dispatch_comments = comments
        self.comments = 0
        self._tail: list[bytes] = []
        # The previous feed ended with CR: an LF opening the next feed belongs to the same break.
        self._cr_pending = False
        self._bom_pending = True
        self._data: list[str] = []
        self._event: str | None = None
        self._last_id: str | None = None
        self._invalid_utf8 = False

    def feed(self, data: bytes) -> list[Event]:
        self.comments = 0
        events: list[Event] = []
        for line in self._lines(data):
            if not line:
                if self._data:
                    events.append(
                        Event(self._event, "\n".join(self._data), self._last_id, self._invalid_utf8)
                    )
                    self._invalid_utf8 = False
                    self._data = []
                self._event = None
                continue
            if line[0] == _COLON:
                self.comments += 1
                if self._dispatch_comments:
                    events.append(COMMENT)
                continue
            colon = line.find(b":")
            if colon < 0:
                name = line
                value = ""
            else:
                name = line[:colon]
                start = colon + 1
                if line[start : start + 1] == b" ":
                    start += 1
                try:
                    value = line[start:].decode()
                except UnicodeDecodeError:
                    self._invalid_utf8 = True
                    value = line[start:].decode("utf-8", "replace")
            if name == b"data":
                self._data.append(value)
            elif name == b"event":
                self._event = value or None
            elif name == b"id" and "\x00" not in value:
                self._last_id = value
            # "retry" and unknown fields are ignored: the relay does not reconnect.
        return events

    def _lines(self, data: bytes) -> list[bytes]:
        """The lines this read completed, without their breaks; the unterminated rest is kept."""
        if not data:
            return []
        if self._cr_pending:
            self._cr_pending = False
            if data[0] == _LF:
                data = data[1:]
                if not data:
                    return []
        self._cr_pending = data[-1] == _CR
        lines = _split_lines(data)
        rest = lines.pop()
        if lines:
            if self._tail:
                self._tail.append(lines[0])
                lines[0] = b"".join(self._tail)
                self._tail = []
            if self._bom_pending:
                self._bom_pending = False
                if lines[0].startswith(_BOM):
                    lines[0] = lines[0][3:]
        if rest:
            self._tail.append(rest)
        return lines

    def close(self) -> list[Event]:
        """End of stream. An event without its closing blank line is discarded, as the spec says."""
        self._tail = []
        self._cr_pending = False
        self._bom_pending = True
        self._data = []
        self._event = None
        self._last_id = None
        self.comments = 0
        return []


def encode(event: str, data: bytes) -> bytes:
    """One named frame. `data` must hold no line break (compact JSON never does)."""
    return b"event: " + event.encode() + b"\ndata: " + data + b"\n\n"


def frame(event: str | None, data: bytes) -> bytes:
    """One event written again as a Decoder read it: its name when it had one, and its data, a
    `data:` line for each of its lines (a Decoder joins them with LF)."""
    head = b"" if event is None else b"event: " + event.encode() + b"\n"
    return head + b"".join(b"data: " + line + b"\n" for line in data.split(b"\n")) + b"\n"


def comment(text: str) -> bytes:
    """One comment line and the blank line after it: what a client's SSE reader skips, and a
    proxy or an idle timeout sees as traffic. Line breaks in `text` become spaces (one line)."""
    if "\r" in text or "\n" in text:
        text = text.replace("\r\n", " ").replace("\r", " ").replace("\n", " ")
    return b": " + text.encode() + b"\n\n" if text else b":\n\n"
