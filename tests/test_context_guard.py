"""The context guard over a real `hal0d serve` and stub servers (their tokenizer a token per word,
their chat template ChatML: /apply-template and /tokenize as llama-server answers them): a prompt
that does not fit a slot's context is refused before any lease, in the words of the client's
SDK (openai's BadRequestError with code context_length_exceeded, anthropic's "prompt is too
long"), or sent to a route's slot that holds it; only a prompt near the limit is counted
exactly; the history row keeps the figures; the model lists show each context."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import orjson
import pytest

from tests.harness.daemons import serving
from tests.harness.poll import eventually
from tests.harness.ports import free_port

STUB = ["{python}", "-m", "hal0d", "stub", "--port", "{port}", "--log", "{log}"]


def stub_slot(tmp_path: Path, name: str, models: list[str], *, context: int | None = None,
              keys: str = "") -> str:
    port = free_port()
    command = [part.format(python=sys.executable,
                           port=port, log=tmp_path / f"{name}.log") for part in STUB]
    return textwrap.dedent(f"""
        [[slots]]
        name = "{name}"
        upstream = "http://127.0.0.1:{port}"
        models = {orjson.dumps(models).decode()}
        command = {orjson.dumps(command).decode()}
        {f"context = {context}" if context else ""}
    """) + keys


def config(tmp_path: Path, port: int, *slots: str, extra: str = "") -> Path:
    path = tmp_path / "hal0d.toml"
    path.write_text(f"[server]\nport = {port}\n" + "".join(slots) + extra + textwrap.dedent(f"""
        [metrics]
        database = "{tmp_path / 'history.sqlite3'}"

        [logging]
        format = "json"
    """))
    return path


def words(count: int) -> str:
    return " ".join(f"w{index}" for index in range(count))


def stub_lines(tmp_path: Path, name: str) -> list[str]:
    log = tmp_path / f"{name}.log"
    return [line.split(" ", 1)[1] for line in log.read_text().splitlines()] if log.exists() else []


async def ready(http: aiohttp.ClientSession, base: str) -> None:
    """Every slot's server up: the guard counts exactly only on a server that answers."""
    async def up() -> bool:
        async with http.get(f"{base}/api/slots") as resp:
            states = [view["state"] for view in (await resp.json())["slots"]]
        assert set(states) == {"ready"}, states
        return True

    await eventually(up, 30, "every slot ready")


async def history_row(http: aiohttp.ClientSession, base: str) -> dict[str, Any]:
    async def newest() -> dict[str, Any]:
        async with http.get(f"{base}/api/requests?limit=1") as resp:
            rows = (await resp.json())["requests"]
        assert rows, "no row yet"
        row: dict[str, Any] = rows[0]
        return row

    return await eventually(newest, 5, "the request's history row")


async def test_a_prompt_past_the_context_is_refused_in_openais_words_before_any_lease(
        tmp_path: Path, http: aiohttp.ClientSession) -> None:
    port = free_port()
    path = config(tmp_path, port, stub_slot(tmp_path, "a", ["chat"], context=300))
    async with serving(path, port) as hal0d:
        await ready(http, hal0d.url)
        client = openai.AsyncOpenAI(base_url=f"{hal0d.url}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(
                model="chat", messages=[{"role": "user", "content": words(400)}])
        assert refused.value.code == "context_length_exceeded"
        body: Any = refused.value.body
        assert body["message"].startswith("This model's maximum context length is 300 tokens. "
                                          "However, your messages resulted in 4"), body
        assert body["type"] == "invalid_request_error" and body["param"] == "messages"
        # Counted exactly (the stub's template and tokenizer), never generated.
        lines = stub_lines(tmp_path, "a")
        assert "apply-template" in lines and "tokenize" in lines, lines
        assert not [line for line in lines if line.startswith("start")], lines
        row = await history_row(http, hal0d.url)
        assert (row["status"], row["error_code"], row["context_tokens"]) == (
            400, "context_exceeded", 300), row
        assert row["prompt_tokens"] > 400, row
        said = hal0d.named("request.context_exceeded")
        assert [(line["slot"], line["context"], line["counted_by"]) for line in said] == [
            ("a", 300, "template")]


async def test_only_a_prompt_near_the_context_is_counted_and_max_tokens_counts_too(
        tmp_path: Path, http: aiohttp.ClientSession) -> None:
    port = free_port()
    path = config(tmp_path, port, stub_slot(tmp_path, "a", ["chat"], context=2000))
    async with serving(path, port) as hal0d:
        await ready(http, hal0d.url)
        client = openai.AsyncOpenAI(base_url=f"{hal0d.url}/v1", api_key="none", max_retries=0)
        short = [{"role": "user", "content": "hi"}]
        await client.chat.completions.create(model="chat", messages=short, max_tokens=4)
        assert "apply-template" not in stub_lines(tmp_path, "a")  # far from the limit: free
        # ~900 words: its bytes (the upper bound) pass the context, its tokens do not.
        near = [{"role": "user", "content": words(900)}]
        answer = await client.chat.completions.create(model="chat", messages=near, max_tokens=4)
        assert answer.choices[0].message.content
        assert stub_lines(tmp_path, "a").count("apply-template") == 1
        # The same prompt leaves no room for 1500 tokens of answer.
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model="chat", messages=near, max_tokens=1500)
        assert refused.value.code == "context_length_exceeded"
        assert "with the 1500 of max_tokens for the answer" in refused.value.message


async def test_claude_codes_sdk_is_told_the_prompt_is_too_long(
        tmp_path: Path, http: aiohttp.ClientSession) -> None:
    port = free_port()
    path = config(tmp_path, port, stub_slot(tmp_path, "a", ["claude"], context=300))
    async with serving(path, port) as hal0d:
        await ready(http, hal0d.url)
        client = anthropic.AsyncAnthropic(base_url=hal0d.url, api_key="none", max_retries=0)
        for stream in (False, True):
            with pytest.raises(anthropic.BadRequestError) as refused:
                if stream:
                    async with client.messages.stream(
                            model="claude", max_tokens=16,
                            messages=[{"role": "user", "content": words(400)}]) as events:
                        async for _ in events:
                            pass
                else:
                    await client.messages.create(
                        model="claude", max_tokens=16,
                        messages=[{"role": "user", "content": words(400)}])
            message = refused.value.body["error"]["message"]  # type: ignore[index]
            assert message.startswith("prompt is too long: 4"), message
            assert message.endswith(" tokens > 300 maximum"), message
        with pytest.raises(anthropic.BadRequestError) as refused:
            await client.messages.create(model="claude", max_tokens=200,
                                         messages=[{"role": "user", "content": words(150)}])
        message = refused.value.body["error"]["message"]  # type: ignore[index]
        assert message.startswith("input length and `max_tokens` exceed context limit: "), message
        assert message.endswith(" + 200 > 300, decrease input length or `max_tokens` and try "
                                "again"), message


async def test_a_route_sends_a_long_prompt_to_the_slot_that_holds_it(
        tmp_path: Path, http: aiohttp.ClientSession) -> None:
    port = free_port()
    route = textwrap.dedent("""
        [[routes]]
        model = "chat"
        slots = ["short", "long"]
    """)
    path = config(tmp_path, port, stub_slot(tmp_path, "short", ["s"], context=300),
                  stub_slot(tmp_path, "long", ["l"], context=8000), extra=route)
    async with serving(path, port) as hal0d:
        await ready(http, hal0d.url)
        client = openai.AsyncOpenAI(base_url=f"{hal0d.url}/v1", api_key="none", max_retries=0)
        answer = await client.chat.completions.create(
            model="chat", messages=[{"role": "user", "content": words(400)}], max_tokens=4)
        assert answer.choices[0].message.content
        row = await history_row(http, hal0d.url)
        assert (row["slot"], row["attempts"], row["failover"]) == ("long", 2,
                                                                    "short=context"), row
        assert not [line for line in stub_lines(tmp_path, "short") if line.startswith("start")]
        # A short prompt still goes to the first.
        await client.chat.completions.create(
            model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert (await history_row(http, hal0d.url))["slot"] == "short"


async def test_each_models_context_is_shown_where_clients_read_it(
        tmp_path: Path, http: aiohttp.ClientSession) -> None:
    port = free_port()
    path = config(tmp_path, port, stub_slot(tmp_path, "a", ["chat"], context=3000),
                  stub_slot(tmp_path, "b", ["other"]))
    async with serving(path, port) as hal0d:
        await ready(http, hal0d.url)
        async with http.get(f"{hal0d.url}/v1/models") as resp:
            listed = {entry["id"]: entry for entry in (await resp.json())["data"]}
        assert (listed["chat"]["context_length"], listed["chat"]["max_model_len"]) == (3000, 3000)
        assert "context_length" not in listed["other"]  # no /props, no key: not known
        async with http.get(f"{hal0d.url}/api/slots") as resp:
            views = {view["name"]: view for view in (await resp.json())["slots"]}
        assert views["a"]["context"] == {"tokens": 3000, "source": "config"}
        assert views["b"]["context"] is None


async def test_a_model_not_loaded_is_not_loaded_for_a_prompt_far_past_its_context(
        tmp_path: Path, http: aiohttp.ClientSession) -> None:
    """An on-demand slot at rest cannot count: a prompt whose likely count (characters / 4) is
    past its context is refused without a load; one that may fit loads, as the server judges.
    The Responses surface answers in its own error object."""
    port = free_port()
    path = config(tmp_path, port, stub_slot(tmp_path, "a", ["chat"], context=300,
                                            keys='start = "on_demand"\n'))
    async with serving(path, port) as hal0d:
        async with http.post(f"{hal0d.url}/v1/responses",
                             json={"model": "chat", "input": words(2000)}) as resp:
            assert resp.status == 400, await resp.text()
            error = (await resp.json())["error"]
        assert error["code"] == "context_length_exceeded", error
        assert error["message"].startswith("This model's maximum context length is 300 tokens"), (
            error)
        async with http.get(f"{hal0d.url}/api/slots") as resp:
            view = (await resp.json())["slots"][0]
        assert view["state"] == "stopped", view
        assert not hal0d.named("slot.load_started")
        assert hal0d.named("request.context_exceeded")[0]["counted_by"] == "estimate"


def conversation(turns: int, words_each: int) -> list[dict[str, str]]:
    """A system prompt, then `turns` user and assistant messages, then a short question."""
    said = [{"role": "system", "content": "You are terse."}]
    for turn in range(turns):
        said.append({"role": "user" if turn % 2 == 0 else "assistant",
                     "content": f"turn{turn} " + words(words_each)})
    return [*said, {"role": "user", "content": "and now?"}]


async def test_ollamas_surface_leaves_out_the_oldest_messages_and_says_so(
        tmp_path: Path, http: aiohttp.ClientSession) -> None:
    """As Ollama does, a conversation past the context is answered from its newest messages
    (the system prompt kept), but said: the log, the history row and prompt_eval_count.
    `[ollama] truncate = false` refuses it in Ollama's words instead."""
    import ollama

    for truncate in (True, False):
        port, ollama_port = free_port(), free_port()
        path = config(tmp_path, port, stub_slot(tmp_path, f"a{truncate}", ["chat"], context=300),
                      extra=f'[ollama]\nlisten = "127.0.0.1:{ollama_port}"\n'
                      f"truncate = {str(truncate).lower()}\n")
        async with serving(path, port) as hal0d:
            await ready(http, hal0d.url)
            client = ollama.AsyncClient(host=f"http://127.0.0.1:{ollama_port}")
            if not truncate:
                with pytest.raises(ollama.ResponseError) as refused:
                    await client.chat(model="chat", messages=conversation(10, 50))
                assert refused.value.status_code == 400
                assert "maximum context length is 300 tokens" in refused.value.error
                continue
            answer = await client.chat(model="chat", messages=conversation(10, 50),
                                       options={"num_predict": 8})
            assert answer.message.content
            assert answer.prompt_eval_count is not None and answer.prompt_eval_count + 8 <= 300
            told = hal0d.named("ollama.truncated")
            assert len(told) == 1 and told[0]["dropped_messages"] >= 5, told
            # The system prompt and the newest messages: what is left is the conversation's end.
            assert told[0]["kept_messages"] == 12 - told[0]["dropped_messages"], told
            row = await history_row(http, hal0d.url)
            assert (row["status"], row["dropped_messages"], row["context_tokens"]) == (
                200, told[0]["dropped_messages"], None), row


def test_the_oldest_go_first_the_system_prompt_and_the_newest_stay_and_calls_keep_answers(
        ) -> None:
    from hal0d.ollama.truncate import drop_oldest_messages

    said = conversation(6, 10)
    kept, gone = drop_oldest_messages(said, shed=30, counted=100)
    assert kept[0]["role"] == "system" and kept[-1] == said[-1]
    assert gone == 3 and kept[1:] == said[4:]  # the three oldest turns, ~33 tokens
    kept, gone = drop_oldest_messages(said[:1] + said[-1:], shed=50, counted=100)
    assert gone == 0  # only the system prompt and the question: nothing may go
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"id": "c1", "type": "function",
                            "function": {"name": "ls", "arguments": "{}"}}]}
    answer = {"role": "tool", "tool_call_id": "c1", "content": "a b c"}
    kept, gone = drop_oldest_messages([said[0], call, answer, said[-1]], shed=1, counted=100)
    assert kept == [said[0], said[-1]] and gone == 2  # the call went, its answer with it
