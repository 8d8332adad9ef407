"""Loads, restores and other models' requests at once on a real model server: three on-demand
llama-server slots of the SmolLM2 file in one group of `max_loaded = 1`, each saving its prompt
caches, and two conversations a model talking at once.

- `policy = "fifo"` (every request for another model swaps) for RUN_S: every swap saves the
  victim's conversations and restores the loading model's, so requests for the other models keep
  arriving while a restore is under way: the moment a group once answered with a false "no room"
  and put a model into load backoff. Every turn is answered, none fails a task of hal0d's, and a
  turn after a swap reads mostly from the restored cache.
- the group's defaults (batch, turns priced by the measured swaps) for BATCH_RUN_S: every
  conversation is answered at least BATCH_TURNS times with no error, and every turn after a
  conversation's first reads at most 10 % of its prompt (a restored turn included).

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
    get_json,
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


BATCH_RUN_S = 60.0
BATCH_TURNS = 5
# A first prompt of ~600 tokens: a later turn's new part (its question and the last answer of
# at most BATCH_ANSWER tokens) is then under a tenth of it.
BATCH_NOTE_WORDS = 520
BATCH_ANSWER = 12
COLD_SHARE = 0.1


def three_models(**group: Any) -> dict[str, Any]:
    config: dict[str, Any] = {"groups": {"cpu": {"max_loaded": 1, **group}}, "slots": []}
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

    def __init__(self, base: str, model: str, seed: int, until: float, *,
                 words: int = NOTE_WORDS, max_tokens: int = 24) -> None:
        super().__init__(daemon=True)
        self.base, self.model, self.until = base, model, until
        self.talk = Conversation(seed, words=words)
        self.max_tokens = max_tokens
        self.usages: list[Any] = []
        self.errors: list[str] = []

    def run(self) -> None:
        while time.monotonic() < self.until:
            try:
                self.usages.append(self.talk.turn(self.base, self.model,
                                                  max_tokens=self.max_tokens))
            except openai.APIError as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}")


def logged(folder: Path, event: str) -> list[str]:
    """hal0d's log lines of `event` (its console form: time, [level], event, key=value ...)."""
    return [line for line in (folder / "hal0d.log").read_text().splitlines()
            if line.split(" ", 3)[2:3] == [event]]


def test_three_models_swapping_with_restores_answer_every_turn_and_stay_warm(
        tmp_path: Path) -> None:
    require_real_server()
    with running_hal0d(tmp_path, three_models(policy="fifo"), stopped) as base:
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


def test_three_models_under_the_groups_defaults_answer_every_conversation_warm(
        tmp_path: Path) -> None:
    require_real_server()
    with running_hal0d(tmp_path, three_models(), stopped) as base:
        until = time.monotonic() + BATCH_RUN_S
        talkers = [Talker(base, model, seed=10 * n + k, until=until, words=BATCH_NOTE_WORDS,
                          max_tokens=BATCH_ANSWER)
                   for n, model in enumerate(MODELS) for k in range(CONVERSATIONS_PER_MODEL)]
        for talker in talkers:
            talker.start()
        for talker in talkers:
            talker.join(timeout=BATCH_RUN_S + 300)
            assert not talker.is_alive(), f"{talker.model}'s conversation never ended"
        groups = get_json(f"{base}/api/slots")["groups"]
    errors = [error for talker in talkers for error in talker.errors]
    turns = [len(talker.usages) for talker in talkers]
    later = [usage for talker in talkers for usage in talker.usages[1:]]
    cold = [round(1 - cached_share(usage), 3) for usage in later]
    read = sum(u.prompt_tokens - u.prompt_tokens_details.cached_tokens for u in later)
    first = [talker.usages[0].prompt_tokens for talker in talkers if talker.usages]
    print(f"\nturns per conversation {turns}, {len(errors)} errors; first prompts {first}; "
          f"later turns read {read} of {sum(u.prompt_tokens for u in later)} prompt tokens, "
          f"the most a turn read {max(cold, default=0):.1%}; restores "
          f"{len(logged(tmp_path, 'slot.cache_restored'))}; group {groups}")
    assert not errors, errors
    assert not logged(tmp_path, "slot.no_room") and not logged(tmp_path, "slot.load_failed")
    assert not logged(tmp_path, "lifecycle.task_failed")
    assert logged(tmp_path, "slot.cache_restored"), "no turn came back to a restored cache"
    assert min(turns) >= BATCH_TURNS, turns
    assert max(cold) <= COLD_SHARE, sorted(cold)[-5:]


@pytest.fixture(autouse=True)
def _real() -> None:
    require_real_server()
