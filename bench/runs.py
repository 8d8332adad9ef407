"""What one `make bench` run is: its plan (how much of everything), its results and skips, how
it tells what it does, and a row's verdict; the names the figures of its shared processes go
under, and the folder its results land in. Apart from bench/run.py so that the sections in their
own modules (lifecycle, swaps, failover, keepalive, overhead), the table and the orchestration
import it, not each other."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import procs

RESULTS = procs.ROOT / "bench" / "results"
BASELINE = "hal0d-baseline"  # the --baseline revision's hal0d, measured beside this tree's
FLOOR = "aiohttp-floor"  # bench/floor.py: the bare proxy on hal0d's stack, in the latency rows


@dataclass
class Plan:
    """How much of everything; --quick shrinks it for a smoke run."""

    latency_pairs: int = 2000
    peer_latency_pairs: int = 2000
    litellm_latency_pairs: int = 300
    warmup: int = 100
    single_chunks: int = 100_000  # ~0.3 s a run: long enough that a scheduling hiccup is noise
    single_rounds: int = 9
    multi_streams: int = 64
    multi_chunks: int = 4000
    multi_rounds: int = 7
    litellm_single_chunks: int = 2000
    litellm_multi_chunks: int = 100
    litellm_rounds: int = 3
    translator_chunks: int = 20000
    memory_streams: int = 1000
    memory_chunks: int = 60
    pace_ms: float = 250.0
    paced_streams: int = 100
    paced_chunks: int = 160  # at 20 ms: 3.2 s, room for the opening, settling and the window
    paced_window_s: float = 2.0
    paced_rounds: int = 5
    # keepalive: streams through a load longer than their client's read timeout
    keepalive_load_s: float = 30.0
    keepalive_read_timeout_s: float = 10.0
    keepalive_s: float = 5.0
    keepalive_streams: int = 8
    # router (make bench-router): each system's wall time, and the words of a conversation's
    # notes (~1,000 prompt tokens with the chat template)
    router_s: float = 75.0
    router_note_words: int = 960
    # context: chat completions of each kind (bench/context.py)
    context_requests: int = 500

    @classmethod
    def quick(cls) -> Plan:
        return cls(latency_pairs=200, peer_latency_pairs=200, litellm_latency_pairs=30,
                   warmup=20, single_chunks=5000, single_rounds=3, multi_chunks=300,
                   multi_rounds=2, litellm_single_chunks=300, litellm_multi_chunks=20,
                   litellm_rounds=2, translator_chunks=5000, memory_streams=200,
                   memory_chunks=24, paced_streams=50, paced_chunks=100, paced_window_s=1.0,
                   paced_rounds=1, keepalive_load_s=12.0, keepalive_read_timeout_s=4.0,
                   keepalive_s=2.0, router_s=20.0, router_note_words=300,
                   context_requests=100)


@dataclass
class Run:
    plan: Plan
    workdir: Path
    started: float = field(default_factory=time.time)
    results: dict[str, Any] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)


def say(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def verdict(ok: bool | None) -> str:
    return "info" if ok is None else ("PASS" if ok else "FAIL")
