"""The demo's stall bounds, on a real `hal0d serve` started from a copy of etc/hal0d.toml (only the
ports and the stub's log path rewritten): the `stall` model shows the stall-guard frame within the
demo slot's own idle bound, not the production 5 minutes, while the README's tour and the
`reasoning` model's `long` prompt finish well inside the slot's total bound."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hal0d import config as configuration
from tests.demo import running_demo


@dataclass
class Demo:
    port: int
    bounds: configuration.DispatcherConfig  # the demo slot's effective timeouts

    def post(self, path: str, body: dict[str, Any], timeout: float) -> tuple[bytes, float]:
        """The whole answer and how long it took."""
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        started = time.monotonic()
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            raw = resp.read()
        return raw, time.monotonic() - started


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Demo]:
    with running_demo(tmp_path_factory.mktemp("demo")) as running:
        loaded = configuration.load(running.config)
        yield Demo(running.port, loaded.slots[0].timeouts(loaded.dispatcher))


def test_the_demo_slot_sets_short_bounds_of_its_own():
    loaded = configuration.load(Path(__file__).resolve().parents[1] / "etc" / "hal0d.toml")
    slot = loaded.slots[0]
    assert slot.stream_idle_timeout_s is not None and slot.stream_idle_timeout_s <= 5
    assert slot.stream_total_timeout_s is not None and slot.stream_total_timeout_s <= 30
    assert loaded.dispatcher.stream_idle_timeout_s == 300.0  # production values untouched


def test_the_stall_model_shows_the_stall_guard_frame_within_the_demo_idle_bound(demo: Demo):
    idle = demo.bounds.stream_idle_timeout_s
    raw, took = demo.post(
        "/v1/chat/completions",
        {"model": "stall", "stream": True, "messages": [{"role": "user", "content": "hi"}]},
        timeout=demo.bounds.stream_total_timeout_s,
    )
    frames = [json.loads(line[len(b"data: "):]) for line in raw.split(b"\n")
              if line.startswith(b"data: {") and b"x_hal0_stall" in line]
    assert len(frames) == 1, raw[-500:]
    stall = frames[0]["x_hal0_stall"]
    assert (stall["reason"], stall["upstream"], stall["stream_idle_timeout_s"]) == (
        "idle", "llm", idle
    )
    assert idle <= stall["elapsed_s"] < idle + 1.0
    assert took < idle + 2.0
    assert raw.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions",
     {"model": "reasoning", "stream": True, "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/chat/completions", {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/chat/completions",  # the longest demo answer: content until the default max_tokens
     {"model": "reasoning", "stream": True, "messages": [{"role": "user", "content": "long"}]}),
    ("/llm/v1/messages", {"model": "reasoning", "max_tokens": 64, "stream": True,
                          "messages": [{"role": "user", "content": "hi"}]}),
])
def test_normal_demo_requests_finish_well_inside_the_demo_total_bound(
    demo: Demo, path: str, body: dict[str, Any]
):
    total = demo.bounds.stream_total_timeout_s
    raw, took = demo.post(path, body, timeout=total)
    assert b"x_hal0_stall" not in raw and b"stall guard" not in raw, raw[-500:]
    assert b"error" not in raw, raw[-500:]
    assert took < total / 2, f"{path} {body['model']} took {took:.1f} s of the {total} s bound"
    print(f"\n{path} {body['messages'][0]['content']!r} ({body['model']}): {took:.2f} s")
