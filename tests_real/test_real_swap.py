"""Model swapping on a real model server: two on-demand slots serve the same SmolLM2 file under
two names, each its own llama-server on its own port, in one group with `max_loaded = 1`.
Requests alternate between the two names, and between the openai and anthropic SDKs, so every
request must unload the other model and load its own before it is answered (nothing else is
queued, so a batching group swaps at once too).

Run by `make test-real` (see test_real_model.py for the server and the model).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from typing import Any, Self

import aiohttp
import anthropic
import openai
import pytest
from realserver import free_port, get_json, require_real_server, running_hal0d, server_command
from realserver import slots as slot_views

MODELS = {"smol-a": "smollm2-a", "smol-b": "smollm2-b"}
# The states in which a slot's process is alive or being started (hal0d.lifecycle.groups.LOADED).
LOADED = {"starting", "ready", "serving", "error", "stopping"}
PROMPT = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def hal0d(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    require_real_server()
    config: dict[str, Any] = {"groups": {"cpu": {"max_loaded": 1}}, "slots": []}
    for slot, model in MODELS.items():
        port = free_port()
        config["slots"].append({
            "name": slot, "upstream": f"http://127.0.0.1:{port}", "models": [model],
            "command": server_command(model, port), "start": "on_demand", "group": "cpu",
            "load_timeout_s": 120.0, "max_concurrent": 1,
        })
    with running_hal0d(tmp_path_factory.mktemp("swap"), config,
                       lambda views: all(v["state"] == "stopped" for v in views.values())) as base:
        yield base


class LoadedSampler:
    """Reads /api/slots in a thread every 20 ms and keeps every instant at which more than one
    slot of the group was loaded (or loading)."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.samples = 0
        self.overlaps: list[dict[str, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            try:
                states = {name: v["state"] for name, v in slot_views(self.base).items()}
            except (aiohttp.ClientError, OSError):
                continue
            self.samples += 1
            if sum(state in LOADED for state in states.values()) > 1:
                self.overlaps.append(states)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def openai_stream(base: str, model: str) -> str:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    text, finish = "", None
    for chunk in client.chat.completions.create(model=model, max_tokens=24, stream=True,
                                                messages=PROMPT):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish in ("stop", "length"), f"the stream ended without a finish_reason: {text!r}"
    return text


def openai_whole(base: str, model: str) -> str:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    answer = client.chat.completions.create(model=model, max_tokens=24, messages=PROMPT)
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.usage is not None and answer.usage.completion_tokens > 0
    return answer.choices[0].message.content or ""


def anthropic_stream(base: str, model: str) -> str:
    client = anthropic.Anthropic(base_url=f"{base}/llm", api_key="unused", max_retries=0)
    with client.messages.stream(model=model, max_tokens=24, messages=PROMPT) as stream:
        message = stream.get_final_message()  # raises unless message_stop arrived
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.content and message.content[-1].type == "text"
    return message.content[-1].text


def anthropic_whole(base: str, model: str) -> str:
    client = anthropic.Anthropic(base_url=f"{base}/llm", api_key="unused", max_retries=0)
    message = client.messages.create(model=model, max_tokens=24, messages=PROMPT)
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.output_tokens > 0
    assert message.content and message.content[-1].type == "text"
    return message.content[-1].text


# Each call asks for the other model than the one before it, by the other SDK.
CALLS: list[tuple[str, Callable[[str, str], str]]] = [
    ("smol-a", openai_stream),
    ("smol-b", anthropic_stream),
    ("smol-a", anthropic_whole),
    ("smol-b", openai_whole),
    ("smol-a", openai_whole),
    ("smol-b", anthropic_whole),
]


def test_alternating_models_swap_each_time_and_every_answer_is_complete(hal0d: str) -> None:
    pids: list[int] = []
    with LoadedSampler(hal0d) as sampler:
        for slot, call in CALLS:
            text = call(hal0d, MODELS[slot])
            assert text.strip(), f"{call.__name__} to {slot} answered nothing"
            views = slot_views(hal0d)
            other = next(name for name in MODELS if name != slot)
            assert views[slot]["state"] == "ready", views[slot]
            assert views[other]["state"] == "stopped", views[other]
            # A new process each time: the model was loaded for this request, not kept.
            pid = views[slot]["pid"]
            assert pid is not None and pid not in pids, (pid, pids)
            pids.append(pid)
    assert sampler.samples > 0
    assert not sampler.overlaps, f"two models loaded at once: {sampler.overlaps[:3]}"
    rows = get_json(f"{hal0d}/api/requests?limit={len(CALLS)}")["requests"]
    assert len(rows) == len(CALLS)
    # Every request waited for its own model's load, and finished well (the openai SDK closes a
    # stream as soon as it reads [DONE], often before this server ends its body: still ok).
    assert all(row["status"] == 200 and row["ok"] and row["load_ms"] > 0 for row in rows), [
        (row["slot"], row["endpoint"], row["status"], row["error_code"], row["load_ms"])
        for row in rows]
    assert [row["slot"] for row in reversed(rows)] == [slot for slot, _ in CALLS]


def test_the_server_answers_responses_and_native_messages_itself(hal0d: str) -> None:
    """What this server serves, recorded for hal0d's native surfaces: llama-server has its own
    POST /v1/responses and POST /v1/messages, so `anthropic = "auto"` and `responses = "auto"`
    choose native against it."""
    views = slot_views(hal0d)
    loaded = next((name for name, v in views.items() if v["state"] == "ready"), "smol-a")
    if views[loaded]["state"] != "ready":
        openai_whole(hal0d, MODELS[loaded])
    upstream = slot_views(hal0d)[loaded]["upstream"]
    statuses: dict[str, int] = {}

    async def ask() -> None:
        async with aiohttp.ClientSession() as session:
            for path, body in (
                ("/v1/responses", {"model": MODELS[loaded], "input": "Say hello.",
                                   "max_output_tokens": 8}),
                ("/v1/messages", {"model": MODELS[loaded], "max_tokens": 8, "messages": PROMPT}),
            ):
                async with session.post(upstream + path, json=body) as resp:
                    await resp.read()
                    statuses[path] = resp.status

    asyncio.run(ask())
    assert statuses == {"/v1/responses": 200, "/v1/messages": 200}, statuses
