"""llama-server's captured answers (tests/fixtures/llama-server/) read back: the HTTP head, the
body's chunks as the server wrote them (the chunked transfer encoding undone, as hal0d's client
reads them), and when each arrived, so a test can replay the answer as the server sent it.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from tests.fixtures_util import fixture_path

PREFILL_PINGS = "llama-server/stream-prefill-pings"
# What the prefill capture generated, and the counts of its usage chunk.
PREFILL_TEXT = "You're ready to"
PREFILL_PROMPT_TOKENS = 1780
PREFILL_COMPLETION_TOKENS = 4
# Headers of the capture that belong to its connection, not to its answer.
_HOP_BY_HOP = {"transfer-encoding", "keep-alive", "connection", "content-length"}


@dataclass(frozen=True)
class Capture:
    status: int
    headers: tuple[tuple[str, str], ...]  # the answer's own (hop-by-hop ones left out)
    chunks: tuple[bytes, ...]  # the body as the server wrote it, one entry per HTTP chunk
    times: tuple[float, ...]  # seconds from the request to each chunk's arrival

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)

    @property
    def comment_chunks(self) -> int:
        """How many of the chunks are comment lines (llama-server's keepalive while it reads
        the prompt)."""
        return sum(1 for chunk in self.chunks if chunk.startswith(b":"))


def read_capture(name: str) -> Capture:
    """`name`.http (the whole answer) and `name`.times.json (when its reads came)."""
    raw = fixture_path(f"{name}.http").read_bytes()
    head, _, rest = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    status = int(status_line.split(" ")[1])
    headers = []
    for line in header_lines:
        key, _, value = line.partition(":")
        if key.lower() not in _HOP_BY_HOP:
            headers.append((key, value.strip()))
    chunks: list[bytes] = []
    wire: list[int] = []  # each chunk's size on the wire, its framing included
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        assert rest[size:size + 2] == b"\r\n", f"{name}: chunk {len(chunks)} is not CRLF-ended"
        chunks.append(rest[:size])
        wire.append(len(size_line) + 2 + size + 2)
        rest = rest[size + 2:]
    reads = orjson.loads(fixture_path(f"{name}.times.json").read_bytes())
    assert reads[0][1] == len(head) + 4, f"{name}: the first read is not the head"
    assert [size for _, size in reads[1:]] == wire, f"{name}: reads do not match the chunks"
    return Capture(status, tuple(headers), tuple(chunks), tuple(at for at, _ in reads[1:]))
