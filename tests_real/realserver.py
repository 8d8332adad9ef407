"""What the real-model tests share: llama-server's and the model's paths that `make test-real`
passes, and a real `hal0d serve` started on a generated config, waited for, and stopped with
SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import tomli_w

from hal0d.config.ports import unused_port as free_port

REAL_SERVER = os.environ.get("HAL0D_REAL_SERVER", "")
REAL_MODEL = os.environ.get("HAL0D_REAL_MODEL", "")
STARTUP_S = 180.0


def require_real_server() -> None:
    if not (Path(REAL_SERVER).exists() and Path(REAL_MODEL).exists()):
        pytest.fail("HAL0D_REAL_SERVER and HAL0D_REAL_MODEL must point at llama-server and the "
                    "model: run this through `make test-real`")


def server_command(model: str, port: int, *, context: int = 2048,
                   extra: Sequence[str] = ()) -> list[str]:
    """llama.cpp's llama-server for the SmolLM2 file, answering to `model` (one sequence, a 2048
    context unless `context` says otherwise, the model's own chat template through jinja, as
    users run it), and `extra` arguments after those."""
    return [REAL_SERVER, "-m", REAL_MODEL, "--alias", model, "--host", "127.0.0.1",
            "--port", str(port), "-c", str(context), "-np", "1", "--jinja", "--no-webui",
            *extra]


def get_json(url: str) -> Any:
    async def fetch() -> Any:
        async with aiohttp.ClientSession() as session, session.get(url) as resp:
            return await resp.json()

    return asyncio.run(fetch())


def slots(base: str) -> dict[str, dict[str, Any]]:
    return {s["name"]: s for s in get_json(f"{base}/api/slots")["slots"]}


@contextlib.contextmanager
def running_hal0d(folder: Path, config: dict[str, Any],
                  settled: Callable[[dict[str, dict[str, Any]]], bool]) -> Iterator[str]:
    """`hal0d serve` on `config` (its port chosen here) until `settled(slots)`; yields its URL."""
    port = free_port()
    path = folder / "hal0d.toml"
    path.write_text(tomli_w.dumps({
        "metrics": {"database": str(folder / "history.sqlite3")},
        **config,
        "server": {**config.get("server", {}), "port": port},
    }))
    log_path = folder / "hal0d.log"
    base = f"http://127.0.0.1:{port}"
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "hal0d", "serve", "--config", str(path)],
            stdout=log, stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + STARTUP_S
            while True:
                assert process.poll() is None, log_path.read_text()
                try:
                    if settled(slots(base)):
                        break
                except (aiohttp.ClientError, OSError):
                    pass
                assert time.monotonic() < deadline, log_path.read_text()[-3000:]
                time.sleep(0.5)
            yield base
        finally:
            stop_process(process)


# -- conversations, as an agent holds them -------------------------------------------------------

NOTE_WORDS = 1220
WORDS = ("river", "stone", "light", "garden", "window", "morning", "paper", "music", "winter",
         "forest", "engine", "market", "silver", "letter", "harbor", "candle", "mountain",
         "bridge", "orchard", "lantern", "meadow", "copper", "valley", "thunder", "pocket",
         "island", "ribbon", "castle", "shadow", "feather")


class Conversation:
    """Seeded notes as the system prompt, then a question a turn; each answer is kept."""

    def __init__(self, seed: int, words: int = NOTE_WORDS) -> None:
        self.rng = random.Random(seed)
        notes = " ".join(self.rng.choice(WORDS) for _ in range(words))
        self.messages: list[dict[str, str]] = [
            {"role": "system", "content": f"You answer in one short sentence. Notes {seed}: "
                                          + notes}]
        self.turns = 0

    def turn(self, base: str, model: str, request_id: str | None = None,
             max_tokens: int = 24) -> Any:
        """The next turn, answered; returns its usage."""
        self.turns += 1
        self.messages.append({"role": "user", "content": f"Question {self.turns}: where do "
                                                         f"the notes name the "
                                                         f"{self.rng.choice(WORDS)}?"})
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0,
                               timeout=300)
        answer = client.chat.completions.create(
            model=model, messages=self.messages, max_tokens=max_tokens, temperature=0,
            extra_headers={"X-Request-Id": request_id} if request_id else None)
        self.messages.append({"role": "assistant",
                              "content": answer.choices[0].message.content or "I do not know."})
        assert answer.usage is not None
        return answer.usage


def cached_share(usage: Any) -> float:
    details = usage.prompt_tokens_details
    cached = (details.cached_tokens if details is not None else None) or 0
    return cached / usage.prompt_tokens


def stop_process(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM, so a server or hal0d ends what it started; SIGKILL only if it will not end."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)
