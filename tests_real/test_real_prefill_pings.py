"""A long prompt on a real llama-server: its keepalives while it reads the prompt reach an
Anthropic client as pings, before the first text.

llama-server (`--sse-ping-interval 1`) sends the stream's head at once, then a `:` comment line
every second until the prompt is read; hal0d's Anthropic surface (translated) turns each into
`event: ping`, after message_start. On two CPU cores SmolLM2-135M reads about 330 tokens a second
(tests/fixtures/llama-server/README), so a prompt of some 2,000 tokens takes several seconds. The
anthropic SDK skips pings, so the body it reads is recorded under it by an httpx transport.

Run by `make test-real` (see tests_real/test_real_model.py).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator

import anthropic
import httpx2
import pytest
from realserver import free_port, require_real_server, running_hal0d, server_command

MODEL = "smollm2-long"
CONTEXT = 4096
PING_INTERVAL_S = 1


def long_prompt(sentences: int = 110) -> str:
    """Some 2,000-2,500 tokens of text that no cache holds (a fresh nonce first), and a question."""
    colours = ("red", "green", "blue", "amber", "violet", "grey", "white", "black")
    things = ("lantern", "river", "ledger", "harbour", "orchard", "engine", "compass", "bridge")
    lines = [f"Note {secrets.token_hex(8)}: read the list and answer the question at the end."]
    lines += [f"Item {n}: the {colours[n % 8]} {things[n * 3 % 8]} stood {n * 7 % 97} paces "
              f"from the {things[n % 8]}, and nobody moved it." for n in range(sentences)]
    lines.append("Question: which colour was item 3? Answer with one word.")
    return "\n".join(lines)


class Recording(httpx2.BaseTransport):
    """The SDK's transport, with every read of a response body kept as (seconds since the
    request was sent, bytes)."""

    def __init__(self) -> None:
        self._inner = httpx2.HTTPTransport()
        self.reads: list[tuple[float, bytes]] = []

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        started = time.monotonic()
        response = self._inner.handle_request(request)
        reads = self.reads
        assert isinstance(response.stream, httpx2.SyncByteStream)
        inner: httpx2.SyncByteStream = response.stream

        class Tee(httpx2.SyncByteStream):
            def __iter__(self) -> Iterator[bytes]:
                for piece in inner:
                    reads.append((time.monotonic() - started, piece))
                    yield piece

            def close(self) -> None:
                inner.close()

        return httpx2.Response(response.status_code, headers=response.headers, stream=Tee(),
                               extensions=response.extensions)

    def close(self) -> None:
        self._inner.close()

    def frames(self) -> list[tuple[float, str]]:
        """(when the read that completed it came, its event name or `:` for a comment) per
        SSE frame."""
        out: list[tuple[float, str]] = []
        pending = b""
        for at, piece in self.reads:
            pending += piece.replace(b"\r\n", b"\n")
            *complete, pending = pending.split(b"\n\n")
            for frame in complete:
                first = frame.split(b"\n", 1)[0]
                name = ":" if first.startswith(b":") else first.removeprefix(b"event: ").decode()
                out.append((at, name))
        return out


@pytest.fixture(scope="module")
def hal0d(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    require_real_server()
    port = free_port()
    command = server_command(MODEL, port, context=CONTEXT,
                             extra=["--sse-ping-interval", str(PING_INTERVAL_S)])
    config = {"slots": [{"name": "real-long", "upstream": f"http://127.0.0.1:{port}",
                         "models": [MODEL], "max_concurrent": 1, "anthropic": "translate",
                         "command": command}]}
    with running_hal0d(tmp_path_factory.mktemp("real-prefill"), config,
                       lambda views: views["real-long"]["state"] == "ready") as base:
        yield base


def test_the_anthropic_sdk_stream_gets_pings_while_llama_server_reads_a_long_prompt(
    hal0d: str,
) -> None:
    recording = Recording()
    client = anthropic.Anthropic(base_url=f"{hal0d}/llm", api_key="unused", max_retries=0,
                                 timeout=120.0, http_client=httpx2.Client(transport=recording))
    with client.messages.stream(model=MODEL, max_tokens=8, messages=[
            {"role": "user", "content": long_prompt()}]) as stream:
        message = stream.get_final_message()
    assert message.content and message.content[-1].type == "text"
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.input_tokens > 1500, message.usage

    frames = recording.frames()
    names = [name for _, name in frames]
    assert names[0] == "message_start", names
    assert ":" not in names, names  # the upstream's comments came as pings, not as comments
    first_text = names.index("content_block_start")
    pings = [at for at, name in frames[:first_text] if name == "ping"]
    prefill_s = frames[first_text][0]  # from the request to its first text
    # The prompt took seconds to read: llama-server pinged while it read (each second at most:
    # a batch of the prompt that takes longer holds the next ping back, seen here as gaps of
    # 1-2 s on two cores), and each ping came through as it was sent, not with the answer.
    assert prefill_s >= 2 * PING_INTERVAL_S, f"answered in {prefill_s:.1f} s: lengthen the prompt"
    assert len(pings) >= 2, (pings, prefill_s)
    gaps = [later - earlier for earlier, later in zip(pings, [*pings[1:], frames[first_text][0]],
                                                     strict=True)]
    assert max(gaps) <= 3 * PING_INTERVAL_S, (pings, prefill_s)
    assert frames[first_text][0] - pings[0] >= PING_INTERVAL_S, (pings, frames[first_text])
    assert names[-1] == "message_stop" and "error" not in names
