"""Loads, restores and other models' requests at once on a real model server: three on-demand
llama-server slots of the SmolLM2 file in one group of `max_loaded = 1` (`policy = "fifo"`:
every request for another model swaps), each saving its prompt caches, and two conversations
a model talking at once for RUN_S. Every swap saves the victim's conversations and restores the
loading model's, so requests for the other models keep arriving while a restore is under way:
the moment a group once answered with a false "no room" and put a model into load backoff.

What must hold: every turn answered (no 503, no "no room"), hal0d's lifecycle never failing a
task, every conversation answered again and again, and a turn after a swap read mostly from the
restored cache.

Run by `make test-real` (see test_real_model.py for the server and the model).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import openai
import pytest
from realserver import (
    Conversation,
    cached_share,
    free_port,
    require_real_server,
    running_hal0d,
    server_command,
)

MODELS = ("smol-a", "smol-b", "smol-c")
CONVERSATIONS_PER_MODEL = 2
RUN_S = 45.0
# A first prompt of ~270 tokens: this build of llama-server reads ~160 tokens a second on two
# cores, and the six conversations' first turns are read cold at once.
NOTE_WORDS = 240
CONTEXT = 8192  # two server slots of 4096: one a conversation
SAVE = ["--slot-save-path", "{prompt_cache_dir}", "-np", str(CONVERSATIONS_PER_MODEL)]
WARM_SHARE = 0.9


def three_models() -> dict[str, Any]:
    config: dict[str, Any] = {"groups": {"cpu": {"max_loaded": 1, "policy": "fifo"}},
                              "slots": []}
    for model in MODELS:
        port = free_port()
        config["slots"].append({
            "name": model, "upstream": f"http://127.0.0.1:{port}", "models": [model],
            "command": server_command(model, port, context=CONTEXT, extra=SAVE),
            "start": "on_demand", "group": "cpu", "load_timeout_s": 120.0,
            "max_concurrent": CONVERSATIONS_PER_MODEL, "prompt_cache": "save",
            "save_timeout_s": 30.0,
        })
    return config


def stopped(views: dict[str, dict[str, Any]]) -> bool:
    return all(v["state"] == "stopped" for v in views.values())


class Talker(threading.Thread):
    """One conversation, a turn after the other until `until`; each turn's usage or error."""

    def __init__(self, base: str, model: str, seed: int, until: float) -> None:
        super().__init__(daemon=True)
        self.base, self.model, self.until = base, model, until
        self.talk = Conversation(seed, words=NOTE_WORDS)
        self.usages: list[Any] = []
        self.errors: list[str] = []

    def run(self) -> None:
        while time.monotonic() < self.until:
            try:
                self.usages.append(self.talk.turn(self.base, self.model))
            except openai.APIError as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}")


def logged(folder: Path, event: str) -> list[str]:
    """hal0d's log lines of `event` (its console form: time, [level], event, key=value ...)."""
    return [line for line in (folder / "hal0d.log").read_text().splitlines()
            if line.split(" ", 3)[2:3] == [event]]


def test_three_models_swapping_with_restores_answer_every_turn_and_stay_warm(
        tmp_path: Path) -> None:
    require_real_server()
    with running_hal0d(tmp_path, three_models(), stopped) as base:
        until = time.monotonic() + RUN_S
        talkers = [Talker(base, model, seed=10 * n + k, until=until)
                   for n, model in enumerate(MODELS) for k in range(CONVERSATIONS_PER_MODEL)]
        for talker in talkers:
            talker.start()
        for talker in talkers:
            talker.join(timeout=RUN_S + 300)
            assert not talker.is_alive(), f"{talker.model}'s conversation never ended"
    errors = [error for talker in talkers for error in talker.errors]
    turns = [len(talker.usages) for talker in talkers]
    later = [usage for talker in talkers for usage in talker.usages[1:]]
    warm = sum(cached_share(usage) > WARM_SHARE for usage in later)
    restored = logged(tmp_path, "slot.cache_restored")
    print(f"\nturns per conversation {turns}, {len(errors)} errors; later turns warm: {warm} "
          f"of {len(later)}; restores {len(restored)}, swaps "
          f"{len(logged(tmp_path, 'group.swap_measured'))}")
    assert not errors, errors
    assert not logged(tmp_path, "slot.no_room") and not logged(tmp_path, "slot.load_failed")
    assert not logged(tmp_path, "lifecycle.task_failed")
    assert restored, "no swap restored a conversation"
    assert min(turns) >= 3, turns
    assert warm >= 0.5 * len(later), (warm, len(later))


@pytest.fixture(autouse=True)
def _real() -> None:
    require_real_server()
