"""The Anthropic surface: POST /llm/v1/messages (and /v1/messages), count_tokens.

The request is translated to OpenAI chat completions and handed to the forward path
(hal0d/forward/) as an exchange like any other; a stream comes back through the relay's Anthropic
transform. Before message_start every failure is a real HTTP status with Anthropic's error body;
after it, one `event: error` frame ends the stream.

A slot with `anthropic = "native"` (or "auto", when its upstream has the endpoint: see
hal0d/forward/modes.py) gets the request as the client sent it (only an aliased model renamed),
at its own /v1/messages, with the client's anthropic-version and anthropic-beta headers; its
answer is relayed byte for byte, a stream through the native transform (hal0d/anthropic/native.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import orjson
from aiohttp import web

from hal0d import conversations
from hal0d.anthropic.native import NativeAfterOpening, NativeAnthropic
from hal0d.anthropic.request import (
    MessagesRequest,
    parse_messages_request,
    prompt_text,
    to_openai,
)
from hal0d.anthropic.response import to_anthropic
from hal0d.anthropic.stream import State, Translator
from hal0d.anthropic.transform import AnthropicTransform
from hal0d.appkeys import DISPATCH
from hal0d.errors import Hal0Error, InvalidRequest, UpstreamInvalid
from hal0d.forward import Answer, Attempt, Call, Exchange
from hal0d.forward.context_guard import ContextNeed, as_one_message
from hal0d.forward.exchange import upstream_refusal
from hal0d.forward.modes import NATIVE, TRANSLATE
from hal0d.handlers.body import check_model_and_stream, parse_json_object, read_body
from hal0d.observability.requestinfo import INFO, client_of
from hal0d.protocol.sse import encode
from hal0d.protocol.transform import Transform
from hal0d.routing import Route
from hal0d.transport.tap import normal_usage
from hal0d.transport.tokens import estimate
from hal0d.transport.upstream import SSE_HEADERS, response_headers

ANTHROPIC_FIELD = "{}:"  # how the Anthropic surface names a field in an error message
COUNT_PATH = "/v1/messages/count_tokens"
PING = encode("ping", b'{"type":"ping"}')  # Anthropic's keepalive, as its own API sends it
ESTIMATE = "estimate"  # X-Hal0d-Token-Count of a count made without the model's tokenizer


def model_and_stream(body: dict[str, Any]) -> tuple[str, bool]:
    """What the dispatch needs of any Messages request; a native upstream judges the rest."""
    return check_model_and_stream(body, ANTHROPIC_FIELD)


class Native(Exchange):
    """The client's request at the upstream's own Messages endpoint (`path`), an aliased model
    renamed; its answer passed on as it came. `opened`: whether hal0d's own message_start is
    already out (a keepalive's, on a slot before this one), asked when the stream begins."""

    surface = "anthropic"

    def __init__(self, raw: bytes, model: str, path: str, *, stream: bool,
                 opened: Callable[[], bool] = lambda: False) -> None:
        self.raw, self.model, self.path, self.stream = raw, model, path, stream
        self.opened = opened

    def native_call(self, fwd: Attempt) -> Call:
        return Call(self.path, self.body_for(fwd), params=fwd.request.query, answered_by=self)

    def body_for(self, fwd: Attempt) -> bytes:
        """The client's bytes, unless the slot serves the model by another name or holds its
        answers to max_output_tokens (docs/configuration.md): then the body with those two
        fields set, every other field as the client sent it."""
        served, limit = fwd.route.served_model, fwd.slot.max_output_tokens
        if served == self.model and limit is None:
            return self.raw
        payload: dict[str, Any] = orjson.loads(self.raw)
        payload["model"] = served
        asked = payload.get("max_tokens")
        if limit is not None and type(asked) is int and asked > limit:
            payload["max_tokens"] = limit
        return orjson.dumps(payload)

    async def call(self, fwd: Attempt) -> Call:
        return self.native_call(fwd)

    def whole(self, fwd: Attempt, answer: Answer, data: bytes) -> web.StreamResponse:
        response = super().whole(fwd, answer, data)
        if answer.status == 200 and b'"input_tokens"' in data and b'"usage"' not in data:
            parsed = answer.json(data)  # count_tokens' answer
            if isinstance(parsed, dict) and isinstance(parsed.get("input_tokens"), int):
                fwd.info.prompt_tokens = parsed["input_tokens"]
        return response

    def relay(self, fwd: Attempt, answer: Answer) -> tuple[Mapping[str, str], Transform]:
        if self.opened():  # the upstream's message_start would be the client's second
            return response_headers(answer.headers), NativeAfterOpening()
        return response_headers(answer.headers), NativeAnthropic()


class Messages(Exchange):
    """A Messages request as a chat completion, its answer translated back; on a native slot
    (or an "auto" one whose upstream has the endpoint), the request as the client sent it."""

    translated = True
    surface = "anthropic"

    def __init__(self, raw: bytes, body: dict[str, Any], model: str, *, stream: bool,
                 path: str = "/v1/messages") -> None:
        self.body, self.stream = body, stream
        self.native = Native(raw, model, path, stream=stream, opened=self.opened)
        self._request: MessagesRequest | None = None
        self.input_tokens: int | None = None  # the prompt's count, for message_start
        # The stream's one transform, made when a keepalive needs it or when the relay begins:
        # a message_start a keepalive sent is not sent again.
        self._transform: AnthropicTransform | None = None
        self.translating = True  # this slot's answer is translated (not native, not "auto")

    def request(self) -> MessagesRequest:
        if self._request is None:
            self._request = parse_messages_request(self.body)
        return self._request

    def prepare(self, route: Route) -> None:
        # A request to translate is checked whole before the slot is taken; a native upstream
        # (and one that may turn out native, "auto") gets what the client sent, fields it may
        # know and the translator does not included.
        self.translating = route.slot.anthropic == TRANSLATE
        if self.translating:
            self.request()

    def need(self) -> ContextNeed | None:
        """The prompt and max_tokens, measured against the slot's context (the slot's
        max_output_tokens clamps the answer)."""
        return ContextNeed.of_body(self.native.raw, self.body.get("max_tokens"), self.as_chat,
                                   clamped=True)

    def as_chat(self) -> dict[str, Any]:
        """The request as the chat completion a count reads; one a translator cannot read
        (fields only a native upstream knows) as one message of all its text."""
        try:
            return to_openai(self.request(), served_model=self.native.model)
        except InvalidRequest:
            return as_one_message(self.body.get("system"), self.body.get("messages"),
                                  self.body.get("tools"))

    def opened(self) -> bool:
        """Whether a keepalive sent this stream's message_start."""
        return self._transform is not None and self._transform.translator.state is not State.IDLE

    def transform(self) -> AnthropicTransform:
        if self._transform is None:
            req = self.request()
            self._transform = AnthropicTransform(Translator(
                req.model, input_tokens=self.input_tokens, stop_sequences=req.stop_sequences))
        return self._transform

    def keepalive(self, what: str) -> bytes:
        """Anthropic's `event: ping`, message_start before the first (strict clients: it comes
        first, and the model and input_tokens are known): counted when the slot has counted,
        estimated when the request still waits for its slot (message_delta carries the
        upstream's own count). A slot that may answer natively gets pings only: its upstream
        sends its own message_start."""
        if not (self.translating or self._transform is not None):
            return PING
        transform = self.transform()
        tokens = self.input_tokens
        if tokens is None:
            tokens = estimate(prompt_text(to_openai(self.request(), served_model="")))
        return transform.opening(tokens) + transform.keepalive()

    def failed(self, error: Hal0Error) -> bytes:
        body = error.anthropic_body()
        if self._transform is None:
            return encode("error", orjson.dumps(body))
        # Anthropic's own words (a context error's "prompt is too long: ..."), not OpenAI's.
        return self._transform.failed(body["error"]["message"], body["error"]["type"])

    async def native_mode(self, fwd: Attempt) -> bool:
        """Whether this slot's upstream is sent the request as it is (asked under the lease: an
        "auto" slot's upstream is up to answer the probe)."""
        return fwd.slot.anthropic != TRANSLATE and await fwd.anthropic_mode() == NATIVE

    def payload(self, fwd: Attempt) -> dict[str, Any]:
        return to_openai(self.request(), served_model=fwd.route.served_model,
                         max_output_tokens=fwd.slot.max_output_tokens)

    async def call(self, fwd: Attempt) -> Call | web.StreamResponse:
        if await self.native_mode(fwd):
            self.translating = False
            return self.native.native_call(fwd)
        self.translating = True
        payload = self.payload(fwd)
        if self.stream:
            self.input_tokens, _ = await fwd.count_tokens(payload, prompt_text(payload))
        return Call("/v1/chat/completions", orjson.dumps(payload))

    def refused(self, answer: Answer, data: bytes) -> Hal0Error:
        return upstream_refusal(answer, data)

    def whole(self, fwd: Attempt, answer: Answer, data: bytes) -> web.StreamResponse:
        """A non-streaming chat completion, translated into one Anthropic Messages response."""
        req = self.request()
        try:
            parsed = orjson.loads(data)
        except orjson.JSONDecodeError:
            raise UpstreamInvalid(f"slot {fwd.slot.name!r} answered with invalid JSON") from None
        message = to_anthropic(parsed, model=req.model, stop_sequences=req.stop_sequences)
        # In Anthropic's words, the cached part beside what was read: the whole prompt again.
        fwd.info.apply_usage(normal_usage(message["usage"]))
        return web.Response(body=orjson.dumps(message), content_type="application/json")

    def relay(self, fwd: Attempt, answer: Answer) -> tuple[Mapping[str, str], Transform]:
        return SSE_HEADERS, self.transform()

    def relayed(self, fwd: Attempt, transform: Transform) -> None:
        assert isinstance(transform, AnthropicTransform)
        if fwd.info.prompt_tokens is None:
            fwd.info.prompt_tokens = transform.translator.input_tokens


class CountTokens(Messages):
    """count_tokens: counted with the slot's own tokenizer, or by a native upstream itself. A
    model that is not loaded is never loaded for a count (in a group that holds one model at a
    time it would evict the one serving): its count is an estimate, and says so."""

    def need(self) -> ContextNeed | None:
        return None  # a count, not a generation: it fits nothing

    def unleased(self, fwd: Attempt) -> web.StreamResponse | None:
        if fwd.warm:
            return None
        try:
            text = prompt_text(to_openai(self.request(), served_model=fwd.route.served_model))
        except InvalidRequest:
            # A request only a native upstream reads (fields the translator does not know):
            # the body's own text is what there is to estimate from.
            text = self.native.raw.decode("utf-8", "replace")
        return self.counted(fwd, estimate(text), ESTIMATE)

    async def call(self, fwd: Attempt) -> Call | web.StreamResponse:
        if await self.native_mode(fwd):
            return self.native.native_call(fwd)
        payload = to_openai(self.request(), served_model=fwd.route.served_model)
        return self.counted(fwd, *await fwd.count_tokens(payload, prompt_text(payload)))

    def counted(self, fwd: Attempt, count: int, source: str) -> web.Response:
        fwd.info.prompt_tokens = count
        return web.Response(body=orjson.dumps({"input_tokens": count}),
                            content_type="application/json",
                            headers={"X-Hal0d-Token-Count": source})


async def messages(request: web.Request) -> web.StreamResponse:
    raw = await read_body(request)
    body = parse_json_object(raw)
    model, stream = model_and_stream(body)
    return await request.app[DISPATCH].serve(
        request, model, Messages(raw, body, model, stream=stream),
        client=client_of(request[INFO], body),
        conversation=conversations.of_messages(request.headers, body))


async def count_tokens(request: web.Request) -> web.StreamResponse:
    raw = await read_body(request)
    body = parse_json_object(raw)
    model, _ = model_and_stream(body)
    # count_tokens takes the Messages body without max_tokens; the parser requires one.
    body.setdefault("max_tokens", 1)
    body["stream"] = False
    exchange = CountTokens(raw, body, model, stream=False, path=COUNT_PATH)
    return await request.app[DISPATCH].serve(request, model, exchange,
                                             client=client_of(request[INFO], body))
