"""The one reader of upstream chat-completion stream chunks, as tables: each broken shape refused
with its message, each shape real servers send read into what it says.

The real servers' shapes: llama-cpp-python's from its capture in tests/fixtures/; llama-server's
and vLLM's as their sources write them (tests/fixtures/README.md lists how they differ).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import orjson
import pytest

from hal0d.anthropic import stream as anthropic_stream
from hal0d.ollama import stream as ollama_stream
from hal0d.openai import responses_bridge
from hal0d.protocol.chat_chunk import (
    ChatChunk,
    MalformedChunk,
    ToolCallFragment,
    Unreadable,
    chunk_of,
    read_chunk,
)
from hal0d.protocol.sse import Decoder
from tests.fixtures_util import fixture_path


def choice(delta: Any = None, finish: Any = None, **more: Any) -> dict[str, Any]:
    """A chunk of one choice, as llama-server frames it; `delta` None leaves the key out."""
    first: dict[str, Any] = {"index": 0, "finish_reason": finish, **more}
    if delta is not None:
        first["delta"] = delta
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [first]}


def calls(*entries: Any) -> dict[str, Any]:
    return choice({"tool_calls": list(entries)})


def usage_chunk(usage: Any) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [], "usage": usage}


MALFORMED = [
    pytest.param("data", "upstream chunk is not a JSON object", id="a string"),
    pytest.param(None, "upstream chunk is not a JSON object", id="null"),
    pytest.param([choice({"content": "a"})], "upstream chunk is not a JSON object", id="a list"),
    pytest.param({"choices": {"0": {}}}, "upstream chunk: choices is not a list",
                 id="choices an object"),
    pytest.param({"choices": "x"}, "upstream chunk: choices is not a list", id="choices a string"),
    pytest.param({"choices": {}}, "upstream chunk: choices is not a list",
                 id="choices an empty object"),
    pytest.param({"choices": [5]}, "upstream chunk: choices[0] is not an object",
                 id="choice a number"),
    pytest.param(choice("hi"), "upstream chunk: delta is not an object", id="delta a string"),
    pytest.param(choice([]), "upstream chunk: delta is not an object", id="delta a list"),
    pytest.param(choice({"content": 5}), "upstream chunk: delta.content is not a string",
                 id="content a number"),
    pytest.param(choice({"content": ["a"]}), "upstream chunk: delta.content is not a string",
                 id="content a list"),
    pytest.param(choice({"reasoning_content": ["x"]}),
                 "upstream chunk: delta reasoning is not a string", id="reasoning_content a list"),
    pytest.param(choice({"reasoning": 1}), "upstream chunk: delta reasoning is not a string",
                 id="vLLM reasoning a number"),
    pytest.param(choice({"reasoning_content": "x", "reasoning": {}}),
                 "upstream chunk: delta reasoning is not a string",
                 id="either reasoning field wrong"),
    pytest.param(choice({"tool_calls": {"index": 0}}),
                 "upstream chunk: delta.tool_calls is not a list", id="tool_calls an object"),
    pytest.param(choice({"tool_calls": "call"}),
                 "upstream chunk: delta.tool_calls is not a list", id="tool_calls a string"),
    pytest.param(calls("f"), "upstream chunk: a tool call is not an object",
                 id="tool call a string"),
    pytest.param(calls({"index": 0, "function": "f"}),
                 "upstream chunk: tool call function is not an object", id="function a string"),
    pytest.param(calls({"index": "0", "function": {"name": "f"}}),
                 "upstream chunk: tool call index is not an integer", id="index a string"),
    pytest.param(calls({"index": True, "function": {"name": "f"}}),
                 "upstream chunk: tool call index is not an integer", id="index a bool"),
    pytest.param(calls({"index": 0.0, "function": {"name": "f"}}),
                 "upstream chunk: tool call index is not an integer", id="index a float"),
    pytest.param(calls({"index": 0, "id": 7, "function": {"name": "f"}}),
                 "upstream chunk: tool call id, name or arguments is not a string",
                 id="id a number"),
    pytest.param(calls({"index": 0, "function": {"name": ["f"]}}),
                 "upstream chunk: tool call id, name or arguments is not a string",
                 id="name a list"),
    pytest.param(calls({"index": 0, "function": {"name": "f", "arguments": {"q": 1}}}),
                 "upstream chunk: tool call id, name or arguments is not a string",
                 id="arguments an object"),
    pytest.param(choice({}, finish=1), "upstream chunk: finish_reason is not a string",
                 id="finish_reason a number"),
    pytest.param(usage_chunk([1]), "upstream chunk: usage is not an object", id="usage a list"),
    pytest.param(usage_chunk(3), "upstream chunk: usage is not an object", id="usage a number"),
    pytest.param(usage_chunk({"completion_tokens": "3"}),
                 "upstream chunk: usage token counts are not integers", id="count a string"),
    pytest.param(usage_chunk({"prompt_tokens": -1}),
                 "upstream chunk: usage token counts are not integers", id="count negative"),
    pytest.param(usage_chunk({"prompt_tokens": 2.5}),
                 "upstream chunk: usage token counts are not integers", id="count a float"),
    pytest.param(usage_chunk({"prompt_tokens": True}),
                 "upstream chunk: usage token counts are not integers", id="count a bool"),
    pytest.param(usage_chunk({"completion_tokens_details": 0}),
                 "upstream chunk: usage.completion_tokens_details is not an object",
                 id="details a number"),
    pytest.param(usage_chunk({"completion_tokens_details": {"reasoning_tokens": "2"}}),
                 "upstream chunk: usage token counts are not integers",
                 id="reasoning count a string"),
    pytest.param({"error": {"message": "CUDA out of memory", "code": 500, "type": "server_error"}},
                 "upstream reported an error: CUDA out of memory", id="llama-server error"),
    pytest.param({"object": "error", "message": "boom", "type": "BadRequestError", "code": 400},
                 "upstream reported an error: boom", id="vLLM error object"),
    pytest.param({"error": "overloaded"}, "upstream reported an error: overloaded",
                 id="error a string"),
    pytest.param({"error": {"code": 500}}, "upstream reported an error: no message",
                 id="error without a message"),
    pytest.param({**choice({"content": ""}, finish="error"),
                  "error": {"code": "server_error", "message": "provider disconnected"}},
                 "upstream reported an error: provider disconnected",
                 id="error beside a choice that finishes"),
]


@pytest.mark.parametrize(("bad", "message"), MALFORMED)
def test_a_malformed_chunk_is_refused_with_its_message(bad: Any, message: str) -> None:
    with pytest.raises(MalformedChunk) as refused:
        read_chunk(bad)
    assert str(refused.value) == message


ROLE = choice({"role": "assistant", "content": None})
LLAMA_SERVER_TOOL = calls({"index": 0, "id": "call_x1", "type": "function",
                           "function": {"name": "get_weather", "arguments": "{\"ci"}})

READ = [
    pytest.param(ROLE, ChatChunk(), id="the role chunk says nothing"),
    pytest.param(choice({"content": "Hel"}), ChatChunk(content="Hel"), id="text"),
    pytest.param(choice({"content": ""}), ChatChunk(content=""), id="empty text"),
    pytest.param(choice({"reasoning_content": "hmm"}), ChatChunk(reasoning="hmm"),
                 id="llama-server reasoning_content"),
    pytest.param(choice({"reasoning": "so"}), ChatChunk(reasoning="so"), id="vLLM reasoning"),
    pytest.param(choice({"reasoning_content": "a", "reasoning": "a"}), ChatChunk(reasoning="a"),
                 id="both reasoning names, the same text"),
    pytest.param(choice({"content": "x", "reasoning_content": "y"}),
                 ChatChunk(content="x", reasoning="y"), id="text and reasoning in one chunk"),
    pytest.param(LLAMA_SERVER_TOOL,
                 ChatChunk(tool_calls=(ToolCallFragment(0, "call_x1", "get_weather", "{\"ci"),)),
                 id="llama-server tool call start"),
    pytest.param(calls({"index": 0, "function": {"arguments": "ty\"}"}}),
                 ChatChunk(tool_calls=(ToolCallFragment(0, None, None, "ty\"}"),)),
                 id="tool call arguments continued"),
    pytest.param(calls({"id": "chatcmpl-tool-1", "type": "function", "index": 0,
                        "function": {"name": "f"}}),
                 ChatChunk(tool_calls=(ToolCallFragment(0, "chatcmpl-tool-1", "f", ""),)),
                 id="vLLM tool call start without arguments"),
    pytest.param(calls({"id": "c1", "function": {"name": "f", "arguments": "{}"}}),
                 ChatChunk(tool_calls=(ToolCallFragment(None, "c1", "f", "{}"),)),
                 id="a tool call without an index"),
    pytest.param(calls({"index": 0}, {"index": 1, "function": None}),
                 ChatChunk(tool_calls=(ToolCallFragment(0, None, None, ""),
                                       ToolCallFragment(1, None, None, ""))),
                 id="fragments without a function"),
    pytest.param(calls({"index": 0, "id": "a", "function": {"name": "f", "arguments": "{}"}},
                       {"index": 1, "id": "b", "function": {"name": "g", "arguments": "{}"}}),
                 ChatChunk(tool_calls=(ToolCallFragment(0, "a", "f", "{}"),
                                       ToolCallFragment(1, "b", "g", "{}"))),
                 id="two tool calls in one chunk"),
    pytest.param(choice({"tool_calls": None, "content": "a"}), ChatChunk(content="a"),
                 id="tool_calls null"),
    pytest.param(choice({"tool_calls": []}), ChatChunk(), id="tool_calls empty"),
    pytest.param(choice(None), ChatChunk(), id="a choice without a delta"),
    pytest.param(choice({}, finish="stop"), ChatChunk(finish_reason="stop"), id="the finish"),
    pytest.param(choice({}, finish="stop", stop_reason="###"),
                 ChatChunk(finish_reason="stop"), id="vLLM stop_reason beside the finish"),
    pytest.param({**usage_chunk({"completion_tokens": 12, "prompt_tokens": 30,
                                 "total_tokens": 42}),
                  "timings": {"prompt_n": 30, "predicted_n": 12}},
                 ChatChunk(has_usage=True, prompt_tokens=30, completion_tokens=12),
                 id="llama-server usage chunk with timings"),
    pytest.param({**usage_chunk({"completion_tokens": 4, "prompt_tokens": 917,
                                 "prompt_tokens_details": {"cached_tokens": 903}}),
                  "timings": {"cache_n": 903, "prompt_n": 14}},
                 ChatChunk(has_usage=True, prompt_tokens=917, completion_tokens=4,
                           cached_tokens=903),
                 id="llama-server usage chunk of a prompt mostly cached"),
    pytest.param({**choice({}, finish="length"), "timings": {"cache_n": 903, "prompt_n": 14}},
                 ChatChunk(finish_reason="length", cached_tokens=903),
                 id="llama-server finish chunk with timings, no usage"),
    pytest.param({**usage_chunk({"prompt_tokens": 917,
                                 "prompt_tokens_details": {"cached_tokens": "903"}}),
                  "timings": {"cache_n": 903}},
                 ChatChunk(has_usage=True, prompt_tokens=917, cached_tokens=903),
                 id="a cache figure that is no count is none, not a malformed chunk"),
    pytest.param({**choice({"reasoning": "Hmm"}),
                  "usage": {"prompt_tokens": 10, "total_tokens": 11, "completion_tokens": 1}},
                 ChatChunk(reasoning="Hmm", has_usage=True, prompt_tokens=10,
                           completion_tokens=1),
                 id="vLLM continuous usage on an output chunk"),
    pytest.param({**choice({"content": "a"}), "usage": None}, ChatChunk(content="a"),
                 id="usage null before the last chunk"),
    pytest.param(usage_chunk({}), ChatChunk(has_usage=True), id="usage without counts"),
    pytest.param(usage_chunk({"prompt_tokens": 5, "completion_tokens": 9,
                              "completion_tokens_details": {"reasoning_tokens": 4}}),
                 ChatChunk(has_usage=True, prompt_tokens=5, completion_tokens=9,
                           reasoning_tokens=4),
                 id="OpenAI reasoning tokens"),
    pytest.param(usage_chunk({"completion_tokens_details": None}), ChatChunk(has_usage=True),
                 id="details null"),
    pytest.param({"choices": []}, ChatChunk(), id="no choices"),
    pytest.param({}, ChatChunk(), id="an empty object"),
    pytest.param({**choice({"content": "a"}), "error": None}, ChatChunk(content="a"),
                 id="error null"),
]


@pytest.mark.parametrize(("chunk", "expected"), READ)
def test_a_well_formed_chunk_is_read_as_what_it_says(chunk: Any, expected: ChatChunk) -> None:
    """`expected` leaves out the choice: it is choices[0] itself, for the Anthropic stop."""
    read = read_chunk(chunk)
    first = chunk["choices"][0] if chunk.get("choices") else None
    assert read == dataclasses.replace(expected, choice=first)
    assert read.choice is first


def test_the_llama_cpp_python_capture_reads_as_its_answer() -> None:
    raw = fixture_path("llama-cpp-python-0.3.36-smollm2-stream.sse").read_bytes()
    datas = [event.data for event in Decoder().feed(raw)]
    assert datas[-1] == "[DONE]"
    reads = [read_chunk(orjson.loads(data)) for data in datas[:-1]]
    assert "".join(read.content or "" for read in reads) == (
        "Hello, welcome to my little corner of the world!")
    assert [read.finish_reason for read in reads] == [None] * (len(reads) - 1) + ["stop"]
    assert not any(read.reasoning or read.tool_calls or read.has_usage for read in reads)


def test_a_chunk_is_read_without_being_changed() -> None:
    chunk = {**LLAMA_SERVER_TOOL, "usage": {"prompt_tokens": 1, "completion_tokens": 2}}
    before = orjson.dumps(chunk)
    read_chunk(chunk)
    assert orjson.dumps(chunk) == before


def test_every_surface_raises_the_one_malformed_chunk() -> None:
    """One definition: a caller catching any surface's MalformedChunk catches the reader's, and
    Ollama's Incomplete (a stream that ends without a finish_reason) is one of them."""
    assert issubclass(MalformedChunk, ValueError)
    assert anthropic_stream.MalformedChunk is MalformedChunk
    assert ollama_stream.MalformedChunk is MalformedChunk
    assert responses_bridge.MalformedChunk is MalformedChunk
    assert issubclass(ollama_stream.Incomplete, MalformedChunk)


def test_an_event_is_its_json_done_is_none_and_text_that_is_no_chunk_is_unreadable() -> None:
    decoder = Decoder()
    events = decoder.feed(b'data: {"choices": []}\n\ndata: [DONE]\n\ndata: {"cut\n\n'
                          b"data: \xff\xfe\n\n")
    assert [e.data[:6] for e in events[:2]] == ['{"choi', "[DONE]"]
    assert chunk_of(events[0]) == {"choices": []}
    assert chunk_of(events[1]) is None
    with pytest.raises(Unreadable, match=r"^upstream sent a chunk that is not JSON$"):
        chunk_of(events[2])
    with pytest.raises(Unreadable, match=r"^upstream sent text that is not UTF-8$"):
        chunk_of(events[3])
