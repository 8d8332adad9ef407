"""Conversations that stay warm on a real model server: llama-server's prompt cache kept across
a swap and a restart of hal0d (`prompt_cache = "save"`), and a route's turns kept on the
replica that holds the conversation.

Each llama-server runs the SmolLM2 file with `--parallel 1` (one server slot: its cache is one
conversation) and a 4096 context; a conversation is a system prompt of notes (~1,250 prompt
tokens with the chat template) and a short question a turn. A turn is warm when the server
read it from its cache: usage.prompt_tokens_details.cached_tokens, which hal0d relays as the
server sent it, above 90 % of its prompt_tokens (a cold turn reads 0 from it).

Run by `make test-real` (see test_real_model.py for the server and the model).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

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
from realserver import slots as slot_views

CONTEXT = 4096
WARM_SHARE = 0.9
SAVE = ["--slot-save-path", "{prompt_cache_dir}"]
def on_demand_pair(folder_name: str) -> dict[str, Any]:
    """Two on-demand slots of the same file, `a` and `b`, in a group of max_loaded = 1."""
    config: dict[str, Any] = {"groups": {"cpu": {"max_loaded": 1}}, "slots": []}
    for name in ("a", "b"):
        port = free_port()
        config["slots"].append({
            "name": name, "upstream": f"http://127.0.0.1:{port}", "models": [f"smol-{name}"],
            "command": server_command(f"smol-{name}", port, context=CONTEXT, extra=SAVE),
            "start": "on_demand", "group": "cpu", "load_timeout_s": 120.0,
            "max_concurrent": 1, "prompt_cache": "save",
        })
    return config


def stopped(views: dict[str, dict[str, Any]]) -> bool:
    return all(v["state"] == "stopped" for v in views.values())


def ready(views: dict[str, dict[str, Any]]) -> bool:
    return all(v["state"] == "ready" for v in views.values())


@pytest.fixture(autouse=True)
def _real() -> None:
    require_real_server()


def test_a_conversation_swapped_out_and_back_reads_its_next_turn_from_the_restored_cache(
        tmp_path: Path) -> None:
    talk = Conversation(seed=1)
    with running_hal0d(tmp_path, on_demand_pair("swap"), stopped) as base:
        first = talk.turn(base, "smol-a")
        assert first.prompt_tokens >= 1200, first
        assert cached_share(first) < 0.5, first  # the first turn is read, not restored
        Conversation(seed=2).turn(base, "smol-b")  # evicts a (its cache saved)
        assert slot_views(base)["a"]["state"] == "stopped"
        usage = talk.turn(base, "smol-a")  # evicts b, loads a (its cache restored)
        views = slot_views(base)
    assert cached_share(usage) > WARM_SHARE, (usage, views["a"].get("prompt_cache"))


def test_a_conversation_reads_its_next_turn_from_the_cache_after_hal0d_restarts(
        tmp_path: Path) -> None:
    """hal0d stopped with SIGTERM (as systemd stops it) saves the loaded slot's cache; started
    again on the same config and state folder (only its own listening port differs), it
    restores it into the slot's new process before the slot takes a request."""
    port = free_port()
    config = {"slots": [{
        "name": "a", "upstream": f"http://127.0.0.1:{port}", "models": ["smol"],
        "command": server_command("smol", port, context=CONTEXT, extra=SAVE),
        "start": "always", "load_timeout_s": 120.0, "max_concurrent": 1,
        "prompt_cache": "save",
    }]}
    talk = Conversation(seed=3)
    with running_hal0d(tmp_path, config, ready) as base:
        first = talk.turn(base, "smol")
        assert first.prompt_tokens >= 1200, first
    with running_hal0d(tmp_path, config, ready) as base:
        usage = talk.turn(base, "smol")
        views = slot_views(base)
    assert cached_share(usage) > WARM_SHARE, (usage, views["a"].get("prompt_cache"))


def test_two_conversations_over_a_route_of_two_replicas_each_stay_on_their_replica(
        tmp_path: Path) -> None:
    """The first turns of two conversations at once: spill_when_busy sends the second to the
    second replica while the first holds the first. Then their later turns one at a time, so
    the first replica is free for each of them: each goes back to the replica that served its
    conversation (hal0d's affinity; without it, every one would go to the first replica, and
    the second conversation would be read there from its start) and reads only its new
    tokens. Each replica reads with one thread: two busy at once on two cores."""
    config: dict[str, Any] = {"slots": [], "routes": [
        {"model": "smol", "slots": ["r1", "r2"], "spill_when_busy": True}]}
    for name in ("r1", "r2"):
        port = free_port()
        config["slots"].append({
            "name": name, "upstream": f"http://127.0.0.1:{port}", "models": [f"smol-{name}"],
            "command": server_command("smol", port, context=CONTEXT, extra=["-t", "1"]),
            "load_timeout_s": 120.0, "max_concurrent": 1,
        })
    talks = {"c1": Conversation(seed=10), "c2": Conversation(seed=11)}
    usages: dict[str, list[Any]] = {name: [] for name in talks}
    errors: list[Exception] = []

    def first_turn(name: str, delay: float, base: str) -> None:
        time.sleep(delay)
        try:
            usages[name].append(talks[name].turn(base, "smol", f"{name}-1"))
        except Exception as exc:  # re-raised in the test's own thread
            errors.append(exc)

    with running_hal0d(tmp_path, config, ready) as base:
        threads = [threading.Thread(target=first_turn, args=(name, 0.3 * i, base))
                   for i, name in enumerate(talks)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=600)
        if errors:
            raise errors[0]
        for k in range(2, 5):
            for name, talk in talks.items():
                usages[name].append(talk.turn(base, "smol", f"{name}-{k}"))
        rows = get_json(f"{base}/api/requests?limit=20")["requests"]
    served = {name: [row["slot"] for row in sorted(rows, key=lambda row: row["request_id"])
                     if row["request_id"].startswith(f"{name}-")] for name in talks}
    assert {name: len(slots) for name, slots in served.items()} == {"c1": 4, "c2": 4}, served
    assert served["c1"][0] != served["c2"][0], served  # the second spilled to the other replica
    assert all(len(set(slots)) == 1 for slots in served.values()), served
    shares = {name: [round(cached_share(u), 3) for u in turns] for name, turns in usages.items()}
    assert all(share > WARM_SHARE for turns in shares.values() for share in turns[1:]), (
        shares, served)
