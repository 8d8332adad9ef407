"""The benchmark's upstream: a fast OpenAI-compatible server with no token pacing.

A plain asyncio.Protocol speaking just enough HTTP/1.1 (keep-alive, Content-Length request
bodies, chunked responses), so that the upstream costs as little CPU as possible and the
figures are about the proxy in front of it. Every answer is built from bytes prepared at start.

Chunks look like llama-server's (one `data:` event per token, a role-only opening chunk, a
finish chunk, a usage chunk when `stream_options.include_usage` is set, `data: [DONE]`); each
SSE event is its own HTTP chunk, as a real server writes one event per token.

    model "bench"   streams max_tokens content chunks as fast as the socket takes them
    model "paced"   one content chunk every --pace-ms (the memory run's slowly paced streams)
    model "paced-N" one content chunk every N ms

With --log PATH every streamed answer writes `start RID`, then `end RID` or `cancel RID` (the
connection went away first), RID being the request's X-Request-Id: `make soak` counts the
generations left running for nobody from these lines.

Run: python -m bench.upstream --port P [--pace-ms 250] [--log PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import signal
from typing import IO, Any, ClassVar

import orjson

WORDS = [" and", " the", " model", " keeps", " talking", " about", " nothing", " in",
         " particular", " today"]
CREATED = 1736000000
CHUNK_ID = "chatcmpl-bench0123456789abcdef0"
MAX_BODY = 1 << 20
DEFAULT_TOKENS = 16


def _chunk_event(model: str, choice: dict[str, Any] | None, **extra: Any) -> bytes:
    payload: dict[str, Any] = {
        "choices": [choice] if choice else [],
        "created": CREATED,
        "id": CHUNK_ID,
        "model": model,
        "system_fingerprint": "b4500-bench",
        "object": "chat.completion.chunk",
        **extra,
    }
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def sse_events(model: str, n: int, include_usage: bool) -> tuple[bytes, list[bytes], list[bytes]]:
    """(opening event, the cycle of token events, closing events) of one streamed answer."""
    opening = _chunk_event(model, {"finish_reason": None, "index": 0,
                                   "delta": {"role": "assistant", "content": None}})
    tokens = [_chunk_event(model, {"finish_reason": None, "index": 0, "delta": {"content": w}})
              for w in WORDS]
    closing = [_chunk_event(model, {"finish_reason": "length" if n else "stop", "index": 0,
                                    "delta": {}})]
    if include_usage:
        closing.append(_chunk_event(model, None, usage={
            "prompt_tokens": 9, "completion_tokens": n, "total_tokens": 9 + n}))
    closing.append(b"data: [DONE]\n\n")
    return opening, tokens, closing


def http_chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


SSE_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n")


def json_response(body: bytes, status: bytes = b"200 OK") -> bytes:
    return (b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


MODELS_BODY = json_response(orjson.dumps({"object": "list", "data": [
    {"id": m, "object": "model", "owned_by": "bench"} for m in ("bench", "paced", "paced-20")]}))
TOKENIZE_BODY = json_response(b'{"tokens":[1,2,3,4,5,6,7,8,9]}')
NOT_FOUND = json_response(b'{"error":{"message":"not found"}}', b"404 Not Found")


def completion_body(model: str) -> bytes:
    return json_response(orjson.dumps({
        "id": "chatcmpl-bench0123456789abcdef0", "object": "chat.completion",
        "created": CREATED, "model": model,
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": "Hello! How can I help?"}}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 7, "total_tokens": 16},
    }))


class Upstream(asyncio.Protocol):
    """One client connection; requests on it are answered strictly one after another."""

    pace_s = 0.25
    generations: ClassVar[IO[str] | None] = None  # --log
    _completions: ClassVar[dict[str, bytes]] = {}
    _events: ClassVar[dict[tuple[str, int, bool], tuple[bytes, list[bytes], list[bytes]]]] = {}

    def __init__(self) -> None:
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.busy: asyncio.Task[None] | None = None
        self.can_write = asyncio.Event()
        self.can_write.set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.set_write_buffer_limits(high=256 * 1024)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.can_write.set()
        if self.busy is not None:
            self.busy.cancel()

    def pause_writing(self) -> None:
        self.can_write.clear()

    def resume_writing(self) -> None:
        self.can_write.set()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.busy is None:
            self._next()

    def _next(self) -> None:
        """Parse one complete request from the buffer and answer it."""
        while self.transport is not None and self.busy is None:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].decode("latin-1").split("\r\n")
            method, path, _ = head[0].split(" ", 2)
            length = 0
            rid = "-"
            for line in head[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value.strip())
                elif name.strip().lower() == "x-request-id":
                    rid = value.strip()
            if length > MAX_BODY:
                self.transport.close()
                return
            start = end + 4
            if len(self.buf) < start + length:
                return
            body = self.buf[start:start + length]
            self.buf = self.buf[start + length:]
            self._answer(method, path.split("?", 1)[0], body, rid)

    def _answer(self, method: str, path: str, body: bytes, rid: str = "-") -> None:
        assert self.transport is not None
        if method == "GET" and path.endswith("/models"):
            self.transport.write(MODELS_BODY)
            return
        if method != "POST":
            self.transport.write(NOT_FOUND)
            return
        if path.endswith("tokenize") or path.endswith("tokenize/count"):
            self.transport.write(TOKENIZE_BODY)
            return
        if not path.endswith("/chat/completions"):
            self.transport.write(NOT_FOUND)
            return
        req = orjson.loads(body)
        model = str(req.get("model", "bench"))
        if not req.get("stream"):
            answer = self._completions.get(model)
            if answer is None:
                answer = self._completions[model] = completion_body(model)
            self.transport.write(answer)
            return
        n = req.get("max_tokens") or req.get("max_completion_tokens") or DEFAULT_TOKENS
        options = req.get("stream_options") or {}
        key = (model, n, bool(options.get("include_usage")))
        events = self._events.get(key)
        if events is None:
            if len(self._events) > 64:
                self._events.clear()
            events = self._events[key] = sse_events(model, n, key[2])
        pace = 0.0
        if model.startswith("paced"):
            _, _, ms = model.partition("-")
            pace = float(ms) / 1000 if ms else self.pace_s
        self.busy = asyncio.get_running_loop().create_task(
            self._logged(rid, self._stream(events, n, pace)))
        self.busy.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self.busy = None
        if not task.cancelled() and task.exception() is not None and self.transport:
            self.transport.close()
        self._next()

    async def _logged(self, rid: str, stream: Any) -> None:
        log = self.generations
        if log is None:
            await stream
            return
        log.write(f"start {rid}\n")
        try:
            ended = await stream
        except asyncio.CancelledError:
            log.write(f"cancel {rid}\n")
            raise
        log.write(f"{'end' if ended else 'cancel'} {rid}\n")

    async def _stream(self, events: tuple[bytes, list[bytes], list[bytes]], n: int,
                      pace: float) -> bool:
        """True when the whole answer was written, False when the connection went first."""
        opening, tokens, closing = events
        framed = [http_chunk(t) for t in tokens]
        cycle = len(framed)
        write = self._write
        write(SSE_HEAD + http_chunk(opening))
        for i in range(n):
            if pace:
                await asyncio.sleep(pace)
            elif not self.can_write.is_set():
                await self.can_write.wait()
            if self.transport is None:
                return False
            write(framed[i % cycle])
        write(b"".join(http_chunk(c) for c in closing) + b"0\r\n\r\n")
        return self.transport is not None

    def _write(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)


async def serve(host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Upstream, host, port, backlog=4096, reuse_address=True)
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    print(f"bench upstream on {host}:{port}", flush=True)
    await stop.wait()
    server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--pace-ms", type=float, default=250.0)
    parser.add_argument("--log", help="log each generation's start and end or cancel here")
    args = parser.parse_args()
    if args.log:
        Upstream.generations = open(args.log, "a", buffering=1)  # noqa: SIM115 (process-long)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    Upstream.pace_s = args.pace_ms / 1000
    asyncio.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
