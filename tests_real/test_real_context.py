"""The context guard on real llama-server processes running SmolLM2-135M: `short` at `-c 2048` and
`long` at `-c 8192` (one sequence each, so a request's context is all of `-c`, as /props'
`n_ctx` says: no context is written in hal0d's config), and a route `ctx` over both, the short
one first.

What it proves, with the openai and anthropic clients against one real `hal0d serve`:
- the contexts are read from the servers themselves: /v1/models shows 2048 for `smollm2` and
  8192 for the route (its longest), /api/slots says where each figure came from;
- a prompt of about 3,000 tokens to `smollm2` is refused in OpenAI's shape (BadRequestError,
  `context_length_exceeded`, both figures) and in Anthropic's ("prompt is too long: M tokens >
  2048 maximum"), and llama-server never reads it: its prompt-token counter (/metrics) does not
  move;
- the same prompt to the route is answered by `long`, the history row saying `short` handed it
  on for its context;
- a prompt of about 1,900 tokens with `max_tokens` 400 leaves no room for the answer and is
  refused; with `max_tokens` 100 it is answered.

Run by `make test-real` (HAL0D_REAL_SERVER, HAL0D_REAL_MODEL); about 20 s.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest
from realserver import (
    WORDS,
    free_port,
    get_json,
    require_real_server,
    running_hal0d,
    server_command,
    slots,
)

SHORT_PORT, LONG_PORT = free_port(), free_port()


@pytest.fixture(scope="module")
def hal0d(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    require_real_server()
    config = {
        "slots": [
            {"name": "short", "upstream": f"http://127.0.0.1:{SHORT_PORT}",
             "models": ["smollm2"],
             "command": server_command("smollm2", SHORT_PORT, context=2048,
                                       extra=["--metrics"])},
            {"name": "long", "upstream": f"http://127.0.0.1:{LONG_PORT}",
             "models": ["smollm2-long"],
             "command": server_command("smollm2-long", LONG_PORT, context=8192)},
        ],
        "routes": [{"model": "ctx", "slots": ["short", "long"],
                    "served": {"short": "smollm2", "long": "smollm2-long"}}],
    }
    with running_hal0d(tmp_path_factory.mktemp("context"), config,
                       lambda views: {v["state"] for v in views.values()} == {"ready"}) as base:
        yield base


def prompt_of(tokens: int) -> str:
    """About `tokens` of SmolLM2's tokens of plain words (its tokenizer, asked through the short
    server, decides: each word is one token or more)."""
    text = " ".join(WORDS[index % len(WORDS)] for index in range(tokens))
    counted = len(post_json(f"http://127.0.0.1:{SHORT_PORT}/tokenize", {"content": text})
                  ["tokens"])
    return " ".join(WORDS[index % len(WORDS)] for index in range(tokens * tokens // counted))


def post_json(url: str, body: dict[str, Any]) -> Any:
    import asyncio

    import aiohttp

    async def post() -> Any:
        async with aiohttp.ClientSession() as session, session.post(url, json=body) as resp:
            return await resp.json()

    return asyncio.run(post())


def prompt_tokens_read() -> float:
    """llama-server's own count of the prompt tokens it has read (`--metrics`)."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{SHORT_PORT}/metrics") as resp:
        text = resp.read().decode()
    found = re.search(r"^llamacpp:prompt_tokens_total (\S+)$", text, re.MULTILINE)
    assert found is not None, text[:500]
    return float(found[1])


def test_the_contexts_are_the_servers_own(hal0d: str) -> None:
    listed = {entry["id"]: entry for entry in get_json(f"{hal0d}/v1/models")["data"]}
    assert listed["smollm2"]["context_length"] == 2048
    assert listed["ctx"]["context_length"] == listed["ctx"]["max_model_len"] == 8192
    views = slots(hal0d)
    assert views["short"]["context"] == {"tokens": 2048, "source": "server"}
    assert views["long"]["context"] == {"tokens": 8192, "source": "server"}


def test_a_prompt_past_the_context_is_refused_in_each_clients_words_unread(hal0d: str) -> None:
    long_prompt = prompt_of(3000)
    before = prompt_tokens_read()
    client = openai.OpenAI(base_url=f"{hal0d}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="smollm2", max_tokens=16,
                                       messages=[{"role": "user", "content": long_prompt}])
    assert refused.value.code == "context_length_exceeded"
    body: Any = refused.value.body
    assert body["message"].startswith(
        "This model's maximum context length is 2048 tokens. However, your messages resulted "
        "in 3"), body
    messages = anthropic.Anthropic(base_url=hal0d, api_key="none", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as too_long:
        messages.messages.create(model="smollm2", max_tokens=16,
                                 messages=[{"role": "user", "content": long_prompt}])
    said = too_long.value.body["error"]["message"]  # type: ignore[index]
    assert re.fullmatch(r"prompt is too long: 3\d{3} tokens > 2048 maximum", said), said
    assert prompt_tokens_read() == before  # llama-server never read it


def test_the_route_answers_it_from_the_longer_context(hal0d: str) -> None:
    client = openai.OpenAI(base_url=f"{hal0d}/v1", api_key="none", max_retries=0)
    answer = client.chat.completions.create(
        model="ctx", max_tokens=16, messages=[{"role": "user", "content": prompt_of(3000)}])
    assert answer.choices[0].message.content
    assert answer.usage is not None and answer.usage.prompt_tokens > 2048
    row = get_json(f"{hal0d}/api/requests?limit=1")["requests"][0]
    assert (row["slot"], row["failover"]) == ("long", "short=context"), row


def test_a_prompt_that_leaves_no_room_for_its_answer_is_refused(hal0d: str) -> None:
    client = openai.OpenAI(base_url=f"{hal0d}/v1", api_key="none", max_retries=0)
    prompt = [{"role": "user", "content": prompt_of(1850)}]  # about 1,900 with the template
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="smollm2", max_tokens=400, messages=prompt)
    assert "with the 400 of max_tokens for the answer" in refused.value.message
    answer = client.chat.completions.create(model="smollm2", max_tokens=100, messages=prompt)
    assert answer.choices[0].message.content is not None
    assert answer.usage is not None and 1850 <= answer.usage.prompt_tokens <= 1948
