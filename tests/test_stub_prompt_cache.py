"""The stub's llama-server prompt cache and slot API, over real sockets: a next turn reads only
what the conversation added (`timings`, `cached_tokens`, in the shapes captured from the real
llama-server in tests/fixtures/llama-server/), conversations keep to their server slots, a saved
slot restores into a new stub process, GET /slots and the slot actions answer as llama-server's
do (its refusals included), the fault options, where a stream puts its timings, and a prefill
paced by the uncached tokens."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from hal0d_stub.slots import SlotOptions
from tests.fixtures_util import fixture_path
from tests.harness.cli import ROOT
from tests.harness.daemons import stop
from tests.harness.poll import eventually
from tests.harness.ports import free_port
from tests.harness.stubs import Stub, StubFactory
from tests.llama_server_capture import PREFILL_PINGS, read_capture

MAX_TOKENS = 4  # as in the captures: "Hello! I am the"
START_WITHIN_S = 15.0
# Two system prompts that part at their first word: with each other they share two tokens (BOS
# and the system turn's marker), far under llama-server's 10 % similarity, so a conversation
# under one never takes the slot of a conversation under the other.
SYSTEM_A = " ".join(["Alpha speaks about apples, aqueducts and the alphabet."] * 4)
SYSTEM_B = " ".join(["Bravo speaks about boats, bridges and the baroque."] * 4)


def captured(name: str) -> tuple[int | None, Any]:
    """A capture of llama-server: (status, body) of a slot-API file ("200 {...}"), or (None,
    body) of a whole answer."""
    text = fixture_path(f"llama-server/{name}").read_text()
    if text[0].isdigit():
        status, _, body = text.partition(" ")
        return int(status), orjson.loads(body)
    return None, orjson.loads(text)


def keys(value: dict[str, Any]) -> set[str]:
    return set(value)


@pytest.fixture
def start_slots_stub(start_stub: StubFactory) -> StubFactory:
    """The stub in this process on a real port (conftest's start_stub), with these
    SlotOptions."""

    async def start(delay: float = 0.001, **options: Any) -> Stub:
        return await start_stub(delay, slot_options=SlotOptions(**options))

    return start


def opening(system: str, question: str = "What is in the cache?") -> list[dict[str, Any]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def next_turn(messages: list[dict[str, Any]], answer: dict[str, Any],
              question: str = "And now?") -> list[dict[str, Any]]:
    """The conversation as a client sends its next turn: the answer echoed, a new question."""
    reply = answer["choices"][0]["message"]["content"]
    return [*messages, {"role": "assistant", "content": reply},
            {"role": "user", "content": question}]


async def chat(http: aiohttp.ClientSession, url: str, messages: list[dict[str, Any]],
               **extra: Any) -> dict[str, Any]:
    body = {"model": "chat", "messages": messages, "max_tokens": MAX_TOKENS, **extra}
    async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        answer: dict[str, Any] = await resp.json()
    return answer


async def act(http: aiohttp.ClientSession, url: str, id_slot: str | int, action: str,
              body: dict[str, Any] | None = None) -> tuple[int, Any]:
    async with http.post(f"{url}/slots/{id_slot}?action={action}", json=body) as resp:
        return resp.status, await resp.json()


async def slots_of(http: aiohttp.ClientSession, url: str) -> list[dict[str, Any]]:
    async with http.get(f"{url}/slots") as resp:
        assert resp.status == 200
        described: list[dict[str, Any]] = await resp.json()
    return described


def held_after(answer: dict[str, Any]) -> int:
    """What a slot holds after an answer, as llama-server's does: the prompt and all but the
    last generated token (sampled, never decoded into the cache)."""
    usage = answer["usage"]
    return int(usage["prompt_tokens"] + usage["completion_tokens"] - 1)


def selections(stub: Stub) -> list[str]:
    """The slot-select lines of the stub's log, without their time stamps."""
    return [line.split(" ", 1)[1] for line in stub.lines() if " slot-select " in line]


async def test_a_warm_turn_reads_only_what_the_conversation_added(start_slots_stub, http):
    stub = await start_slots_stub()
    messages = opening(SYSTEM_A)
    cold = await chat(http, stub.url, messages)
    warm = await chat(http, stub.url, next_turn(messages, cold))

    assert cold["timings"]["cache_n"] == 0
    assert cold["timings"]["prompt_n"] == cold["usage"]["prompt_tokens"]
    assert cold["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    cache_n = held_after(cold)  # llama-server's capture: 900 + 4 generated -> 903 cached
    assert warm["timings"]["cache_n"] == cache_n
    assert warm["timings"]["prompt_n"] == warm["usage"]["prompt_tokens"] - cache_n
    assert warm["usage"]["prompt_tokens_details"] == {"cached_tokens": cache_n}
    assert warm["timings"]["predicted_n"] == warm["usage"]["completion_tokens"] == MAX_TOKENS
    for answer, name in ((cold, "chat-cold.json"), (warm, "chat-warm.json")):
        _, real = captured(name)
        assert keys(answer) == keys(real)
        assert keys(answer["usage"]) == keys(real["usage"])
        assert keys(answer["timings"]) == keys(real["timings"])
        assert keys(answer["choices"][0]) == keys(real["choices"][0])
        assert keys(answer["choices"][0]["message"]) == keys(real["choices"][0]["message"])


async def test_two_conversations_on_two_slots_each_come_back_to_their_own(start_slots_stub,
                                                                            http):
    stub = await start_slots_stub(parallel=2)
    a, b = opening(SYSTEM_A), opening(SYSTEM_B)
    first_a = await chat(http, stub.url, a)
    first_b = await chat(http, stub.url, b)
    second_a = await chat(http, stub.url, next_turn(a, first_a))
    second_b = await chat(http, stub.url, next_turn(b, first_b))

    # A fresh server's first request takes its highest slot (llama-server's LRU tie-break, as
    # the capture's slot 1 shows); the next, on the other conversation, the one never used.
    assert [line.split(" cache_n")[0] for line in selections(stub)] == [
        "slot-select id_slot=1 by=lru", "slot-select id_slot=0 by=lru",
        "slot-select id_slot=1 by=similarity", "slot-select id_slot=0 by=similarity"]
    assert second_a["timings"]["cache_n"] == held_after(first_a)
    assert second_b["timings"]["cache_n"] == held_after(first_b)
    held = {slot["id"]: slot["n_prompt_tokens"] for slot in await slots_of(http, stub.url)}
    assert held == {0: held_after(second_b), 1: held_after(second_a)}


async def test_id_slot_chooses_the_slot_and_cache_prompt_false_reads_all_again(
    start_slots_stub, http
):
    stub = await start_slots_stub(parallel=2)
    messages = opening(SYSTEM_A)
    first = await chat(http, stub.url, messages)  # slot 1
    pinned = await chat(http, stub.url, next_turn(messages, first), id_slot=0)
    uncached = await chat(http, stub.url, next_turn(messages, first), cache_prompt=False)

    assert pinned["timings"]["cache_n"] == 0  # slot 0 held nothing, though slot 1 held most
    # The same turn again goes where that very prompt now is, but is read whole.
    assert uncached["timings"]["cache_n"] == 0
    assert uncached["timings"]["prompt_n"] == uncached["usage"]["prompt_tokens"]
    assert [line.split(" cache_n")[0] for line in selections(stub)][1:] == [
        "slot-select id_slot=0 by=id_slot", "slot-select id_slot=0 by=similarity"]


async def holding_a_slot(http: aiohttp.ClientSession, url: str, **extra: Any
                         ) -> aiohttp.ClientResponse:
    """A `chatty` stream (it never ends) that holds its slot until it is closed."""
    body = {"model": "chatty", "messages": opening(SYSTEM_A), "stream": True, **extra}
    stream = await http.post(f"{url}/v1/chat/completions", json=body)
    assert await stream.content.readany()  # past the prefill: the slot is processing
    return stream


def events(stub: Stub) -> list[str]:
    return [line.split(" ", 2)[1] for line in stub.lines()]


async def test_an_action_or_a_turn_naming_a_processing_slot_waits_until_it_is_idle(
    start_slots_stub, http, tmp_path
):
    stub = await start_slots_stub(parallel=2, save_path=tmp_path)
    stream = await holding_a_slot(http, stub.url, id_slot=0)
    erase = asyncio.create_task(act(http, stub.url, 0, "erase"))
    pinned = asyncio.create_task(chat(http, stub.url, opening(SYSTEM_B), id_slot=0))
    other = await chat(http, stub.url, opening(SYSTEM_B))  # names no slot: the idle one
    await asyncio.sleep(0.1)
    assert not erase.done() and not pinned.done()  # llama-server defers them
    stream.close()  # the client leaves; the slot is idle
    status, erased = await erase
    await pinned

    seen = events(stub)
    assert seen.index("slot-erase") > seen.index("cancelled")
    assert status == 200 and erased["n_erased"] > 0  # what the stream had read and generated
    assert [line.split(" cache_n")[0] for line in selections(stub)] == [
        "slot-select id_slot=0 by=id_slot", "slot-select id_slot=1 by=lru",
        "slot-select id_slot=0 by=id_slot"]
    assert other["timings"]["cache_n"] == 0


async def test_a_turn_that_finds_every_slot_busy_is_served_at_once_on_none(
    start_slots_stub, http
):
    """Where llama-server would queue it: the stub serves any number of requests at once."""
    stub = await start_slots_stub()
    stream = await holding_a_slot(http, stub.url)
    answer = await chat(http, stub.url, opening(SYSTEM_A))
    stream.close()
    assert answer["timings"]["cache_n"] == 0
    assert selections(stub)[-1] == (
        f"slot-select id_slot=none by=busy cache_n=0 prompt_n={answer['usage']['prompt_tokens']}")


async def test_get_slots_has_the_captured_shape(start_slots_stub, http):
    stub = await start_slots_stub(parallel=2, ctx_size=4096)
    _, real = captured("slots.json")
    fresh = await slots_of(http, stub.url)
    assert [slot["id"] for slot in fresh] == [0, 1]
    assert all(keys(slot) == keys(real[0]) for slot in fresh)
    assert [slot["n_ctx"] for slot in fresh] == [real[0]["n_ctx"], real[1]["n_ctx"]] == [2048] * 2

    answer = await chat(http, stub.url, opening(SYSTEM_A))
    unused, used = await slots_of(http, stub.url)
    assert keys(unused) == keys(real[0])
    assert keys(used) == keys(real[1])
    assert keys(used["next_token"][0]) == keys(real[1]["next_token"][0])
    assert keys(used["params"]) <= keys(real[1]["params"])
    assert used["n_prompt_tokens"] == held_after(answer)
    assert (used["is_processing"], used["params"]["max_tokens"]) == (False, MAX_TOKENS)


async def start_stub_process(port: int, log: Path, save_path: Path) -> asyncio.subprocess.Process:
    """`hal0d stub` as its own process, once it answers."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "hal0d", "stub", "--port", str(port), "--log", str(log),
        "--delay", "0.001", "-np", "2", "--slot-save-path", str(save_path), cwd=ROOT,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL)

    async def answers() -> bool:
        assert process.returncode is None, f"the stub exited with {process.returncode}"
        try:
            async with aiohttp.ClientSession() as session, session.get(
                    f"http://127.0.0.1:{port}/slots") as resp:
                return resp.status == 200
        except aiohttp.ClientConnectionError:
            return False

    try:
        await eventually(answers, START_WITHIN_S, "the stub process answers")
    except BaseException:
        await stop(process)
        raise
    return process


async def test_a_slot_saved_before_a_stop_restores_into_the_next_process_warm(http, tmp_path):
    save_path, log = tmp_path / "slot-files", tmp_path / "stub.log"
    save_path.mkdir()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    messages = opening(SYSTEM_A)
    first_process = await start_stub_process(port, log, save_path)
    try:
        first = await chat(http, url, messages)
        status, saved = await act(http, url, 1, "save", {"filename": "conversation-a.bin"})
    finally:
        await stop(first_process)
    real_status, real_saved = captured("save-slot1.json")
    assert (status, keys(saved), keys(saved["timings"])) == (
        real_status, keys(real_saved), keys(real_saved["timings"]))
    written = (save_path / "conversation-a.bin").stat().st_size
    assert (saved["id_slot"], saved["n_saved"], saved["n_written"]) == (
        1, held_after(first), written)

    second_process = await start_stub_process(port, log, save_path)
    try:
        assert "n_prompt_tokens" not in (await slots_of(http, url))[1]  # a new process
        status, restored = await act(http, url, 1, "restore", {"filename": "conversation-a.bin"})
        warm = await chat(http, url, next_turn(messages, first))
    finally:
        await stop(second_process)
    real_status, real_restored = captured("restore.json")
    assert (status, keys(restored), keys(restored["timings"])) == (
        real_status, keys(real_restored), keys(real_restored["timings"]))
    assert (restored["n_restored"], restored["n_read"]) == (saved["n_saved"], written)
    assert warm["timings"]["cache_n"] == saved["n_saved"]
    lines = log.read_text()
    assert (f"slot-save id_slot=1 filename=conversation-a.bin n_saved={saved['n_saved']} "
            f"n_written={written} status=200") in lines
    assert (f"slot-restore id_slot=1 filename=conversation-a.bin "
            f"n_restored={saved['n_saved']} n_read={written} status=200") in lines


async def test_a_restore_of_a_missing_file_is_llama_servers_400_and_empties_the_slot(
    start_slots_stub, http, tmp_path
):
    stub = await start_slots_stub(save_path=tmp_path)
    messages = opening(SYSTEM_A)
    first = await chat(http, stub.url, messages)
    async with http.post(f"{stub.url}/slots/0?action=restore",
                         json={"filename": "never-saved.bin"}) as resp:
        status, raw = resp.status, await resp.read()
    real_status, real_body = captured("restore-missing.json")
    assert (status, raw) == (real_status, orjson.dumps(real_body))
    assert (await slots_of(http, stub.url))[0]["n_prompt_tokens"] == 0
    assert (await chat(http, stub.url, next_turn(messages, first)))["timings"]["cache_n"] == 0
    assert any("slot-restore id_slot=0 filename=never-saved.bin status=400" in line
               for line in stub.lines())


def refusal(status: int, message: str) -> tuple[int, dict[str, Any]]:
    kind = {400: "invalid_request_error", 500: "server_error"}[status]
    return status, {"error": {"code": status, "message": message, "type": kind}}


@pytest.mark.parametrize(("call", "answer"), [
    (("abc", "erase", None), refusal(400, "Invalid slot ID")),
    (("-1", "erase", None), refusal(400, "Invalid slot ID")),
    (("0", "rename", None), refusal(400, "Invalid action")),
    (("0", "save", {"filename": "../escaped.bin"}), refusal(400, "Invalid filename")),
    (("0", "save", {"filename": "sub/dir.bin"}), refusal(400, "Invalid filename")),
    (("0", "save", {"filename": "back\\slash.bin"}), refusal(400, "Invalid filename")),
    (("0", "save", {"filename": "trailing."}), refusal(400, "Invalid filename")),
    (("0", "restore", {"filename": ""}), refusal(400, "Invalid filename")),
    (("0", "save", {}),
     refusal(500, "[json.exception.out_of_range.403] key 'filename' not found")),
    (("0", "save", {"filename": 7}),
     refusal(500, "[json.exception.type_error.302] type must be string, but is number")),
    (("3", "erase", None), (200, {"id_slot": 3, "n_erased": 0})),  # wraps round to slot 1
])
async def test_slot_actions_are_refused_as_llama_server_refuses_them(
    start_slots_stub, http, tmp_path, call, answer
):
    stub = await start_slots_stub(parallel=2, save_path=tmp_path / "slot-files")
    (tmp_path / "slot-files").mkdir()
    assert await act(http, stub.url, *call) == answer
    assert not (tmp_path / "escaped.bin").exists()


async def test_without_a_slot_save_path_every_action_is_not_supported(start_slots_stub, http):
    stub = await start_slots_stub()
    message = "This server does not support slots action. Start it with `--slot-save-path`"
    for action, body in (("save", {"filename": "a.bin"}), ("restore", {"filename": "a.bin"}),
                         ("erase", None)):
        assert await act(http, stub.url, 0, action, body) == (501, {"error": {
            "code": 501, "message": message, "type": "not_supported_error"}})


async def test_an_erase_answers_in_the_captured_shape(start_slots_stub, http, tmp_path):
    stub = await start_slots_stub(save_path=tmp_path)
    answer = await chat(http, stub.url, opening(SYSTEM_A))
    status, erased = await act(http, stub.url, 0, "erase")
    real_status, real = captured("erase.json")
    assert (status, keys(erased)) == (real_status, keys(real))
    assert erased == {"id_slot": 0, "n_erased": held_after(answer)}
    empty_status, empty = await act(http, stub.url, 0, "save", {"filename": "slot0.bin"})
    real_status, real = captured("save-slot0-empty.json")
    assert (empty_status, keys(empty), empty["n_saved"]) == (real_status, keys(real), 0)


async def test_the_fault_options_fail_or_hang_saves_and_fail_restores(
    start_slots_stub, http, tmp_path
):
    failing = await start_slots_stub(save_path=tmp_path, save_fail=True, restore_fail=True)
    assert await act(http, failing.url, 0, "save", {"filename": "a.bin"}) == refusal(
        500, "Unable to save slot")
    assert not (tmp_path / "a.bin").exists()
    working = await start_slots_stub(save_path=tmp_path)
    assert (await act(http, working.url, 0, "save", {"filename": "a.bin"}))[0] == 200
    assert await act(http, failing.url, 0, "restore", {"filename": "a.bin"}) == refusal(
        400, "Unable to restore slot: No available space in KV cache or invalid slot save file")
    assert [line.split(" ", 1)[1] for line in failing.lines()] == [
        "slot-save id_slot=0 filename=a.bin status=500 error='Unable to save slot'",
        "slot-restore id_slot=0 filename=a.bin status=400 error='Unable to restore slot: "
        "No available space in KV cache or invalid slot save file'"]

    hanging = await start_slots_stub(save_path=tmp_path, save_delay=30.0)
    with pytest.raises(TimeoutError):
        async with http.post(f"{hanging.url}/slots/0?action=save", json={"filename": "b.bin"},
                             timeout=aiohttp.ClientTimeout(total=0.2)):
            pass

    def gave_up() -> list[str]:
        lines = [line.split(" ", 1)[1] for line in hanging.lines()]
        assert lines[-1:] == ["slot-save id_slot=0 cancelled (client went away)"], lines
        return lines

    lines = await eventually(gave_up, 5.0, "the hanging save is cancelled")
    assert lines[0] == "slot-save id_slot=0 filename=b.bin hanging 30 s (--slot-save-delay)"
    assert not (tmp_path / "b.bin").exists()


def sse_payloads(raw: bytes) -> list[dict[str, Any]]:
    events = [event for event in raw.split(b"\n\n") if event.startswith(b"data: {")]
    return [orjson.loads(event[len(b"data: "):]) for event in events]


async def test_a_stream_carries_timings_on_its_last_chunk_as_llama_server_does(
    start_slots_stub, http
):
    stub = await start_slots_stub()
    messages = opening(SYSTEM_A)
    body = {"model": "chat", "messages": messages, "max_tokens": MAX_TOKENS, "stream": True}
    async with http.post(f"{stub.url}/v1/chat/completions", json=body) as resp:
        plain = sse_payloads(await resp.read())
    cold = {"choices": [{"message": {"content": "".join(
        c["choices"][0]["delta"].get("content") or "" for c in plain[1:-1])}}]}
    body |= {"messages": next_turn(messages, cold), "stream_options": {"include_usage": True}}
    async with http.post(f"{stub.url}/v1/chat/completions", json=body) as resp:
        with_usage = sse_payloads(await resp.read())

    # Without usage, the finish_reason chunk is the last and carries them; with usage, only
    # the usage chunk does; no token chunk ever does (without timings_per_token).
    assert ["timings" in chunk for chunk in plain] == [False] * (len(plain) - 1) + [True]
    assert plain[-1]["choices"][0]["finish_reason"] == "length"
    assert ["timings" in chunk for chunk in with_usage] == [False] * (len(with_usage) - 1) + [True]
    usage_chunk = with_usage[-1]
    real = next(chunk for chunk in sse_payloads(read_capture(PREFILL_PINGS).body)
                if "usage" in chunk)
    assert keys(usage_chunk) == keys(real) and usage_chunk["choices"] == []
    assert keys(usage_chunk["usage"]) == keys(real["usage"])
    assert keys(usage_chunk["timings"]) == keys(real["timings"])
    cache_n = usage_chunk["timings"]["cache_n"]
    assert cache_n == plain[-1]["timings"]["prompt_n"] + MAX_TOKENS - 1
    assert usage_chunk["usage"]["prompt_tokens_details"] == {"cached_tokens": cache_n}


async def first_bytes(http: aiohttp.ClientSession, url: str, messages: list[dict[str, Any]]
                      ) -> tuple[float, float, dict[str, Any]]:
    """A streamed turn: seconds to its head and to its first chunk, and its last chunk."""
    body = {"model": "chat", "messages": messages, "max_tokens": MAX_TOKENS, "stream": True,
            "stream_options": {"include_usage": True}}
    started = time.monotonic()
    async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
        head = time.monotonic() - started
        first = await resp.content.readany()
        chunk = time.monotonic() - started
        raw = first + await resp.read()
    return head, chunk, sse_payloads(raw)[-1]


async def test_the_prefill_takes_longer_the_more_of_the_prompt_is_uncached(
    start_slots_stub, http
):
    ms_per_token = 1.0
    stub = await start_slots_stub(prefill_ms_per_token=ms_per_token)
    messages = opening(" ".join([SYSTEM_A] * 10))  # some 330 tokens
    cold_head, cold_chunk, cold = await first_bytes(http, stub.url, messages)
    reply = {"choices": [{"message": {"content": "Hello! I am the"}}]}
    _, warm_chunk, warm = await first_bytes(http, stub.url, next_turn(messages, reply))

    prompt_n = cold["timings"]["prompt_n"]
    assert prompt_n > 300 and warm["timings"]["prompt_n"] < prompt_n / 10
    # The first chunk comes after the prompt is read (a sleep never ends early, and it began
    # after the request was sent), the head long before it (not to the millisecond: the client
    # may wake to the head a moment after the stub sent it and began the prompt); the warm
    # turn, with a tenth of the tokens to read, answers sooner.
    prefill_s = prompt_n * ms_per_token / 1000
    assert cold_chunk >= prefill_s and cold_chunk - cold_head >= prefill_s / 2
    assert cold["timings"]["prompt_ms"] >= prompt_n * ms_per_token
    assert warm_chunk < cold_chunk
    assert warm["timings"]["prompt_ms"] < cold["timings"]["prompt_ms"]
