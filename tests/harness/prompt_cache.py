"""A stub slot that saves its prompt caches, and a conversation against a real `hal0d serve`
in front of it: what the prompt-cache tests share."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from hal0d.config.cache_dir import cache_root
from tests.harness.daemons import Hal0dProcess
from tests.harness.ports import free_port

# A long first message: the later turns add a few tokens, so a warm turn reads almost none.
OPENING = " ".join(f"line {n} of the repository's long context." for n in range(120))
_PORTS: dict[tuple[Path, str], int] = {}


def command(name: str, tmp_path: Path, *extra: str) -> list[str]:
    port = _PORTS.setdefault((tmp_path, name), free_port())
    return [sys.executable, "-m", "hal0d", "stub", "--port", str(port), "--delay", "0.001",
            "--log", str(tmp_path / f"{name}.log"), "--slot-save-path", "{prompt_cache_dir}",
            *extra]


def slot(name: str, model: str, tmp_path: Path, *extra: str, **keys: Any) -> str:
    """An on-demand stub slot that saves its prompt caches (unless `keys` say otherwise)."""
    port = _PORTS.setdefault((tmp_path, name), free_port())
    keys = {"start": "on_demand", "prompt_cache": "save", "save_timeout_s": 2.0, **keys}
    lines = [f'name = "{name}"', f'upstream = "http://127.0.0.1:{port}"',
             f'models = ["{model}"]',
             f"command = {orjson.dumps(command(name, tmp_path, *extra)).decode()}"]
    lines += [f"{key} = {orjson.dumps(value).decode()}" for key, value in keys.items()]
    return "[[slots]]\n" + "\n".join(lines) + "\n"


def messages(n: int) -> list[dict[str, str]]:
    said = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": OPENING}]
    for turn in range(1, n):
        said += [{"role": "assistant", "content": f"noted {turn}"},
                 {"role": "user", "content": f"next {turn}"}]
    return said


async def turn(http: aiohttp.ClientSession, hal0d: Hal0dProcess, model: str, n: int
               ) -> dict[str, Any]:
    """The n-th turn of the conversation, whole; its usage."""
    async with http.post(f"{hal0d.url}/v1/chat/completions", json={
            "model": model, "messages": messages(n), "max_tokens": 4}) as resp:
        body = await resp.json()
        assert resp.status == 200, body
    usage: dict[str, Any] = body["usage"]
    return usage


def cached(usage: dict[str, Any]) -> int:
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def warm(usage: dict[str, Any]) -> bool:
    return cached(usage) > 0.9 * usage["prompt_tokens"]


async def unload(http: aiohttp.ClientSession, hal0d: Hal0dProcess, name: str) -> float:
    """The admin API's unload, to its end; how long it took."""
    started = time.monotonic()
    async with http.post(f"{hal0d.url}/api/slots/{name}/unload") as resp:
        assert resp.status == 200, await resp.text()
    return time.monotonic() - started


def folders(tmp_path: Path, name: str) -> list[str]:
    where = cache_root(tmp_path / "history.sqlite3") / name
    return sorted(p.name for p in where.iterdir()) if where.is_dir() else []
