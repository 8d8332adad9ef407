"""In-process costs, no sockets: the Anthropic translator and the metrics tap, per chunk.

The input is the exact byte stream the bench upstream sends (llama-server-shaped chunks). It is
fed two ways: one SSE event per feed (what a paced model produces: every read is one token) and
in 64 KiB reads (what an unpaced upstream produces under load). The first is the one the target
is judged on, since it is the per-chunk worst case.
"""

from __future__ import annotations

import gc
import statistics
from collections.abc import Callable
from time import perf_counter
from typing import Any

import orjson

from bench.upstream import sse_events
from hal0d.anthropic.stream import Translator, encode_events
from hal0d.anthropic.transform import AnthropicTransform
from hal0d.protocol.sse import Decoder
from hal0d.transport.tap import StreamTap


def upstream_events(chunks: int) -> list[bytes]:
    opening, tokens, closing = sse_events("bench", chunks, include_usage=True)
    return [opening, *(tokens[i % len(tokens)] for i in range(chunks)), *closing]


def in_reads(events: list[bytes], size: int) -> list[bytes]:
    data = b"".join(events)
    return [data[i:i + size] for i in range(0, len(data), size)]


def best_of(repeats: int, run: Callable[[], float]) -> tuple[float, float]:
    """(median, min) seconds of `repeats` runs; gc stays enabled, as in the daemon."""
    times = [run() for _ in range(repeats)]
    return statistics.median(times), min(times)


def time_transform(pieces: list[bytes]) -> float:
    transform = AnthropicTransform(Translator("bench", input_tokens=9))
    feed = transform.feed
    t0 = perf_counter()
    out = 0
    for piece in pieces:
        out += len(feed(piece))
    out += len(transform.end())
    elapsed = perf_counter() - t0
    if not transform.translator.done or transform.translator.stop_reason is None or not out:
        raise RuntimeError("the translator did not finish the bench stream cleanly")
    return elapsed


def time_decoder(pieces: list[bytes]) -> float:
    decoder = Decoder()
    feed = decoder.feed
    t0 = perf_counter()
    for piece in pieces:
        feed(piece)
    return perf_counter() - t0


def time_loads(datas: list[str]) -> float:
    loads = orjson.loads
    t0 = perf_counter()
    for data in datas:
        loads(data)
    return perf_counter() - t0


def time_translator(dicts: list[dict[str, Any]]) -> float:
    translator = Translator("bench", input_tokens=9)
    feed = translator.feed
    t0 = perf_counter()
    for chunk in dicts:
        feed(chunk)
    return perf_counter() - t0


def time_encode(event_lists: list[list[Any]]) -> float:
    t0 = perf_counter()
    for events in event_lists:
        encode_events(events)
    return perf_counter() - t0


def time_tap(pieces: list[bytes]) -> float:
    tap = StreamTap()
    on_chunk = tap.on_chunk
    t0 = perf_counter()
    for piece in pieces:
        on_chunk(piece)
    return perf_counter() - t0


def measure(chunks: int = 20000, repeats: int = 7) -> dict[str, Any]:
    events = upstream_events(chunks)
    reads = in_reads(events, 64 * 1024)
    per = 1e6 / chunks

    datas = [e.data for e in Decoder().feed(b"".join(events)) if e.data != "[DONE]"]
    dicts = [orjson.loads(d) for d in datas]
    probe = Translator("bench", input_tokens=9)
    event_lists = [probe.feed(d) for d in dicts]

    gc.collect()
    results: dict[str, Any] = {"chunks": chunks, "repeats": repeats}
    for name, run in (
        ("transform_per_event", lambda: time_transform(events)),
        ("transform_64k_reads", lambda: time_transform(reads)),
        ("decoder_per_event", lambda: time_decoder(events)),
        ("orjson_loads", lambda: time_loads(datas)),
        ("translator_feed", lambda: time_translator(dicts)),
        ("encode_events", lambda: time_encode(event_lists)),
        ("tap_per_event", lambda: time_tap(events)),
        ("tap_64k_reads", lambda: time_tap(reads)),
    ):
        med, low = best_of(repeats, run)
        results[name] = {"us_per_chunk_median": med * per, "us_per_chunk_min": low * per}
    return results


if __name__ == "__main__":
    for key, value in measure().items():
        print(key, value)
