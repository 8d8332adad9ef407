"""Token quotas, in a real `hal0d serve` with its Ollama listener, asked with the real SDKs: a key
past its `tokens_per_day` is refused on every surface with a 429 in that surface's envelope,
Retry-After and the time the quota resets; what it used is kept across a restart of hal0d (read
back from the history); a stream that crosses its quota finishes whole."""

from __future__ import annotations

import textwrap
import time
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
from ollama import AsyncClient, ResponseError

from tests.harness.config import config_text
from tests.harness.daemons import Hal0dProcess, serving
from tests.harness.ports import free_port
from tests.harness.stubs import Stub

KID, READER, ADMIN = "sk-kid-4Fv7", "sk-reader-9Lm2", "sk-admin-Qe6"
HI = [{"role": "user", "content": "hi"}]


def keys_and_ollama(ollama_port: int) -> str:
    return textwrap.dedent(f"""
        [ollama]
        listen = "127.0.0.1:{ollama_port}"

        [[keys]]
        name = "kid"
        key = "{KID}"
        scopes = ["inference"]
        tokens_per_day = 30

        [[keys]]
        name = "reader"
        key = "{READER}"
        scopes = ["inference"]
        tokens_per_hour = 30
        tokens_per_day = 1000

        [[keys]]
        name = "admin"
        key = "{ADMIN}"
        scopes = ["read", "admin"]
    """)


def write_config(stub: Stub, tmp_path: Path) -> tuple[Path, int, int]:
    port, ollama_port = free_port(), free_port()
    path = tmp_path / "hal0d.toml"
    path.write_text(config_text(stub.url, port, tmp_path, extra=keys_and_ollama(ollama_port)))
    return path, port, ollama_port


def sdk(hal0d: Hal0dProcess, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{hal0d.url}/v1", api_key=key, max_retries=0)


async def key_view(hal0d: Hal0dProcess, name: str) -> dict[str, Any]:
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {ADMIN}"}) as http, \
            http.get(f"{hal0d.url}/api/keys") as resp:
        assert resp.status == 200, await resp.text()
        return next(line for line in (await resp.json())["keys"] if line["name"] == name)


def resets_in(retry_after: str | None) -> float:
    """Retry-After, checked: whole seconds, within the day the quota is counted in."""
    assert retry_after is not None and retry_after.isdigit(), retry_after
    assert 1 <= int(retry_after) <= 25 * 3600, retry_after
    return float(retry_after)


async def refused_everywhere(hal0d: Hal0dProcess, ollama_port: int) -> None:
    """The kid's next request on each surface: 429, its envelope, Retry-After, the reset time."""
    client = sdk(hal0d, KID)
    with pytest.raises(openai.RateLimitError) as chat:
        await client.chat.completions.create(model="chat", messages=HI)  # type: ignore[arg-type]
    error = chat.value.body
    assert isinstance(error, dict) and error["type"] == "insufficient_quota", error
    assert error["code"] == "access.quota_exceeded"
    assert "tokens_per_day is 30" in error["message"] and "resets at" in error["message"]
    resets_in(chat.value.response.headers.get("Retry-After"))

    with pytest.raises(openai.RateLimitError) as responses:
        await client.responses.create(model="chat", input="hi")
    assert "resets at" in str(responses.value.body)
    resets_in(responses.value.response.headers.get("Retry-After"))

    messages = anthropic.AsyncAnthropic(base_url=hal0d.url, api_key=KID, max_retries=0)
    with pytest.raises(anthropic.RateLimitError) as claude:
        await messages.messages.create(model="chat", max_tokens=20, messages=HI)  # type: ignore[arg-type]
    body = claude.value.body
    assert isinstance(body, dict) and body["error"]["type"] == "rate_limit_error", body
    assert "resets at" in body["error"]["message"]
    resets_in(claude.value.response.headers.get("Retry-After"))

    ollama = AsyncClient(host=f"http://127.0.0.1:{ollama_port}",
                         headers={"Authorization": f"Bearer {KID}"})
    with pytest.raises(ResponseError) as local:
        await ollama.chat(model="chat", messages=HI)
    assert local.value.status_code == 429 and "resets at" in local.value.error


async def test_a_key_past_its_daily_quota_is_refused_on_every_surface_and_after_a_restart(
    stub: Stub, tmp_path: Path
) -> None:
    config, port, ollama_port = write_config(stub, tmp_path)
    async with serving(config, port) as hal0d:
        client = sdk(hal0d, KID)
        answered = 0
        for _ in range(10):  # each answer is charged its prompt and its completion
            try:
                await client.chat.completions.create(model="chat", messages=HI)  # type: ignore[arg-type]
            except openai.RateLimitError:
                break
            answered += 1
        assert 1 <= answered < 10
        used = (await key_view(hal0d, "kid"))["quotas"]["day"]
        assert used["used"] >= 30 and used["limit"] == 30
        assert used["resets_at"] > time.time()
        await refused_everywhere(hal0d, ollama_port)
    again = tmp_path / "again" / "hal0d.toml"  # the same config, its log beside it
    again.parent.mkdir()
    again.write_text(config.read_text())
    async with serving(again, port) as hal0d:
        # The day's count is read back from the history: nothing is forgotten.
        assert (await key_view(hal0d, "kid"))["quotas"]["day"]["used"] == used["used"]
        await refused_everywhere(hal0d, ollama_port)
        reader = sdk(hal0d, READER)  # another key's quota is its own
        assert (await reader.chat.completions.create(model="chat", messages=HI)).choices  # type: ignore[arg-type]


async def test_a_stream_that_crosses_its_quota_finishes_and_the_next_request_is_refused(
    stub: Stub, tmp_path: Path
) -> None:
    config, port, _ = write_config(stub, tmp_path)
    async with serving(config, port) as hal0d:
        # A count of a prompt's tokens generates nothing: it is not charged.
        counter = anthropic.AsyncAnthropic(base_url=hal0d.url, api_key=READER, max_retries=0)
        counted = await counter.messages.count_tokens(model="chat", messages=HI)  # type: ignore[arg-type]
        assert counted.input_tokens > 0
        assert (await key_view(hal0d, "reader"))["quotas"]["hour"]["used"] == 0
        client = sdk(hal0d, READER)
        chunks = [chunk async for chunk in await client.chat.completions.create(
            model="reasoning", messages=[{"role": "user", "content": "long"}],  # type: ignore[list-item]
            max_tokens=80, stream=True)]
        # 80 tokens against a quota of 30 an hour: the whole answer, to its finish_reason.
        assert chunks[-1].choices[0].finish_reason == "length"
        assert (await key_view(hal0d, "reader"))["quotas"]["hour"]["used"] > 80
        with pytest.raises(openai.RateLimitError) as refused:
            await client.chat.completions.create(model="chat", messages=HI)  # type: ignore[arg-type]
        assert "tokens_per_hour is 30" in refused.value.body["message"]  # type: ignore[index]
        assert int(refused.value.response.headers["Retry-After"]) <= 3600
