"""The message a stream makes, as the translator writes it: message_start's envelope (its id,
the client's model name, the prompt's count, sent by begin() before the first chunk or at it), the
ids it makes, and the counts message_delta ends with (the upstream's own prompt count, its cached
part), as the anthropic SDK reads them."""

from __future__ import annotations

from hal0d.anthropic.stream import State, Translator, encode_events
from tests.harness.anthropic_stream import (
    DONE,
    call,
    finish,
    play,
    role,
    say,
    sdk_client,
    short,
    usage,
)


def test_message_start_envelope() -> None:
    translator = Translator("my-alias", input_tokens=3, message_id="msg_fixed")
    [(name, payload), *_] = translator.feed(role())
    assert name == "message_start"
    assert payload == {
        "type": "message_start",
        "message": {
            "id": "msg_fixed",
            "type": "message",
            "role": "assistant",
            "model": "my-alias",
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 3, "output_tokens": 0},
        },
    }


def test_begin_sends_message_start_now_and_no_chunk_sends_another() -> None:
    translator = Translator("my-alias", input_tokens=3, message_id="msg_fixed")
    [(name, payload)] = translator.begin()
    assert name == "message_start" and payload["message"]["id"] == "msg_fixed"
    assert payload["message"]["usage"] == {"input_tokens": 3, "output_tokens": 0}
    assert translator.state is State.STREAMING and not translator.done
    assert [short(e) for e in translator.feed(say("a"))] == [
        ("start", 0, "text"), ("delta", 0, "a")]


def test_begin_with_a_count_says_it_until_the_upstream_says_its_own() -> None:
    translator = Translator("m", input_tokens=3)
    assert short(translator.begin(input_tokens=40)[0]) == ("message_start", 40)
    assert translator.input_tokens == 40
    events = translator.feed(say("a")) + translator.feed(finish()) + translator.finish()
    assert short(events[-2]) == ("message_delta", "end_turn", None, 40, 1)  # no upstream count


def test_the_sdk_takes_the_upstreams_prompt_count_from_message_delta_over_message_start() -> None:
    translator = Translator("client-model", input_tokens=7)
    events = translator.begin() + translator.ping()
    events += translator.feed(role()) + translator.feed(say("Hi")) + translator.feed(finish())
    events += translator.feed(usage(1780, 1)) + translator.finish()
    assert events[0][1]["message"]["usage"]["input_tokens"] == 7
    assert events[-2][1]["usage"] == {"input_tokens": 1780, "output_tokens": 1}
    client = sdk_client(encode_events(events))
    with client.messages.stream(
        model="client-model", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        kinds = [event.type for event in stream]
        message = stream.get_final_message()
    assert kinds[0] == "message_start" and "ping" not in kinds  # the SDK skips pings
    assert (message.usage.input_tokens, message.usage.output_tokens) == (1780, 1)
    assert message.content[0].text == "Hi"  # type: ignore[union-attr]


def test_the_prompts_cached_part_is_cache_read_input_tokens_in_message_delta() -> None:
    """llama-server's usage chunk (its prompt_tokens_details and timings: 903 of 917 cached):
    message_start counts the whole prompt, message_delta splits it the way Anthropic does, and
    the SDK's message ends with both."""
    warm = usage(917, 1)
    warm["usage"]["prompt_tokens_details"] = {"cached_tokens": 903}
    warm["timings"] = {"cache_n": 903, "prompt_n": 14}
    translator = Translator("client-model", input_tokens=917)
    events = translator.begin() + translator.feed(role()) + translator.feed(say("Hi"))
    events += translator.feed(finish("length")) + translator.feed(warm) + translator.finish()
    assert events[0][1]["message"]["usage"] == {"input_tokens": 917, "output_tokens": 0}
    assert events[-2][1]["usage"] == {"input_tokens": 14, "cache_read_input_tokens": 903,
                                      "output_tokens": 1}
    client = sdk_client(encode_events(events))
    with client.messages.stream(
        model="client-model", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        message = stream.get_final_message()
    assert (message.usage.input_tokens, message.usage.cache_read_input_tokens) == (14, 903)


def test_timings_alone_say_the_cached_part_and_silence_says_none() -> None:
    """llama-server without include_usage: its timings on the finish chunk; an upstream that
    says nothing of a cache gets no cache_read_input_tokens (not a 0 it did not say)."""
    timed = finish("stop") | {"timings": {"cache_n": 903, "prompt_n": 14}}
    events = play([role(), say("Hi"), timed, DONE], input_tokens=917)
    assert events[-2][1]["usage"] == {"input_tokens": 14, "cache_read_input_tokens": 903,
                                      "output_tokens": 1}
    events = play([role(), say("Hi"), finish("stop"), DONE], input_tokens=917)
    assert events[-2][1]["usage"] == {"input_tokens": 917, "output_tokens": 1}


def test_generated_ids() -> None:
    events = play([role(), call(0, "{}", name="f"), finish("tool_calls"), DONE])
    message_id = events[0][1]["message"]["id"]
    tool_id = events[1][1]["content_block"]["id"]
    assert message_id.startswith("msg_") and len(message_id) == 28
    assert tool_id.startswith("toolu_") and len(tool_id) > 10
