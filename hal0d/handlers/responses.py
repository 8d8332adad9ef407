"""The OpenAI Responses API: POST /v1/responses (and /llm/v1/responses), GET and DELETE
/v1/responses/{id}.

A request is dispatched by `model` like a chat completion (aliases applied) and relayed byte for
byte, status and content type verbatim; a stream goes through the relay with the Responses
transform (hal0d/openai/responses.py), which ends a stalled or broken stream in Responses events.
The id of every answer is remembered with its model (hal0d/response_owners.py), so that GET and
DELETE of an answer reach the slot that holds it; an id hal0d never saw is a 404.

A slot with `responses = "translate"` (or "auto", when its upstream has no /v1/responses: see
hal0d/forward/modes.py) serves only chat completions: the request is translated into one
(hal0d/openai/responses_request.py) and the answer back into a Responses answer
(hal0d/openai/responses_answer.py) or, for a stream, Responses events
(hal0d/openai/responses_bridge.py). Such an answer is kept nowhere, so its id is not remembered.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import orjson
from aiohttp import hdrs, web

from hal0d import conversations
from hal0d.appkeys import DISPATCH, RESPONSE_OWNERS
from hal0d.errors import InvalidRequest, NoRoute, UpstreamInvalid
from hal0d.forward import Answer, Attempt, Call, Exchange
from hal0d.forward.context_guard import ContextNeed, as_one_message
from hal0d.forward.modes import NATIVE, TRANSLATE
from hal0d.handlers.body import parse_json_object, read_body
from hal0d.handlers.openai import model_and_stream, with_model
from hal0d.logs import get_logger
from hal0d.observability.requestinfo import INFO, client_of
from hal0d.openai.responses import ResponsesTransform, response_id_of
from hal0d.openai.responses_answer import to_response
from hal0d.openai.responses_bridge import Bridge, BridgeTransform
from hal0d.openai.responses_request import ChatRequest, chat_request
from hal0d.protocol.limits import MAX_TOKENS_LIMIT
from hal0d.protocol.transform import Transform
from hal0d.response_owners import ResponseOwners
from hal0d.routing import Route
from hal0d.transport.tap import normal_usage
from hal0d.transport.upstream import SSE_HEADERS, response_headers

log = get_logger()


def requested(payload: dict[str, Any]) -> tuple[str, bool]:
    """The model and whether a stream was asked for; what no upstream could serve is refused
    here, in OpenAI's envelope, before a slot is taken."""
    model, stream = model_and_stream(payload)
    given = payload.get("input")
    if given is not None and not isinstance(given, str | list):
        raise InvalidRequest("'input' must be a string or an array", field="input")
    limit = payload.get("max_output_tokens")
    if limit is not None and (type(limit) is not int or not 1 <= limit <= MAX_TOKENS_LIMIT):
        raise InvalidRequest(
            f"'max_output_tokens' must be an integer from 1 to {MAX_TOKENS_LIMIT}, not {limit!r}",
            field="max_output_tokens",
        )
    return model, stream


class NativeResponses(Exchange):
    """The request at the upstream's own /v1/responses; its answer passed on as it came, the id
    of every answer remembered with its model."""

    surface = "responses"

    def __init__(self, body: bytes, model: str, owners: ResponseOwners, *,
                 stream: bool) -> None:
        self.body, self.model, self.owners, self.stream = body, model, owners, stream

    def native_call(self, fwd: Attempt) -> Call:
        body = self.body
        if fwd.route.served_model != self.model:
            body = with_model(body, fwd.route.served_model)
        return Call("/v1/responses", body, params=fwd.request.query, answered_by=self)

    async def call(self, fwd: Attempt) -> Call:
        return self.native_call(fwd)

    def whole(self, fwd: Attempt, answer: Answer, data: bytes) -> web.StreamResponse:
        if answer.status == 200 and (response_id := response_id_of(answer.json(data))):
            self.owners.remember(response_id, self.model, fwd.slot.name)
        return super().whole(fwd, answer, data)

    def relay(self, fwd: Attempt, answer: Answer) -> tuple[Mapping[str, str], Transform]:
        return response_headers(answer.headers), ResponsesTransform(model=fwd.route.served_model)

    def relayed(self, fwd: Attempt, transform: Transform) -> None:
        assert isinstance(transform, ResponsesTransform)
        if transform.response_id is not None:
            self.owners.remember(transform.response_id, self.model, fwd.slot.name)


class Responses(Exchange):
    """A Responses request as a chat completion, the answer translated back (an upstream's error
    status passed on as it came: OpenAI's envelope already); on a native slot (or an "auto" one
    whose upstream has /v1/responses), the request as the client sent it."""

    translated = True
    surface = "responses"

    def __init__(self, body: bytes, payload: dict[str, Any], model: str,
                 owners: ResponseOwners, *, stream: bool) -> None:
        self.payload, self.model, self.stream = payload, model, stream
        self.native = NativeResponses(body, model, owners, stream=stream)
        self.chat: ChatRequest | None = None  # this slot's chat completion

    def prepare(self, route: Route) -> None:
        # A request to translate is checked whole before the slot is taken; a native upstream
        # (and one that may turn out native, "auto") gets what the client sent.
        self.chat = bridged(route, self.payload) if route.slot.responses == TRANSLATE else None

    def need(self) -> ContextNeed | None:
        """The input and max_output_tokens, measured against the slot's context (the slot's
        max_output_tokens clamps a translated answer)."""
        return ContextNeed.of_body(self.native.body, self.payload.get("max_output_tokens"),
                                   self.as_chat, clamped=True)

    def as_chat(self) -> dict[str, Any]:
        """The request as the chat completion a count reads; one the bridge cannot read as one
        message of all its text."""
        if self.chat is not None:
            return self.chat.body
        try:
            return chat_request(self.payload, served_model=self.model).body
        except InvalidRequest:
            return as_one_message(self.payload.get("instructions"), self.payload.get("input"),
                                  self.payload.get("tools"))

    async def call(self, fwd: Attempt) -> Call:
        if self.chat is None and await fwd.responses_mode() == NATIVE:
            return self.native.native_call(fwd)
        if self.chat is None:
            self.chat = bridged(fwd.route, self.payload)
        return Call("/v1/chat/completions", orjson.dumps(self.chat.body))

    def whole(self, fwd: Attempt, answer: Answer, data: bytes) -> web.StreamResponse:
        if answer.status != 200:
            return super().whole(fwd, answer, data)
        assert self.chat is not None
        try:
            response = to_response(orjson.loads(data), self.chat, model=self.model)
        except (orjson.JSONDecodeError, ValueError):
            raise UpstreamInvalid(
                f"slot {fwd.slot.name!r} answered with no chat completion to translate"
            ) from None
        fwd.info.apply_usage(normal_usage(response["usage"]))
        return web.Response(body=orjson.dumps(response), content_type="application/json")

    def relay(self, fwd: Attempt, answer: Answer) -> tuple[Mapping[str, str], Transform]:
        assert self.chat is not None
        return SSE_HEADERS, BridgeTransform(Bridge(self.chat, self.model))


def bridged(route: Route, payload: dict[str, Any]) -> ChatRequest:
    """The chat completion a translated slot is sent (InvalidRequest, 400, for what a chat
    upstream cannot do); the tools left out are logged."""
    chat = chat_request(payload, served_model=route.served_model,
                        max_output_tokens=route.slot.max_output_tokens)
    if chat.tools.dropped:
        log.debug("responses.tools_dropped", slot=route.slot.name,
                  types=sorted(set(chat.tools.dropped)))
    return chat


async def create(request: web.Request) -> web.StreamResponse:
    body = await read_body(request)
    payload = parse_json_object(body)
    model, stream = requested(payload)
    exchange = Responses(body, payload, model, request.app[RESPONSE_OWNERS], stream=stream)
    return await request.app[DISPATCH].serve(
        request, model, exchange, client=client_of(request[INFO], payload),
        conversation=conversations.of_responses(request.headers, payload))


class Stored(Exchange):
    """GET, HEAD or DELETE of a stored answer at the slot that holds it, passed on as it came;
    a HEAD's Content-Length kept (it is its GET's), a deleted answer forgotten."""

    empty_ok = True

    def __init__(self, response_id: str, owners: ResponseOwners, method: str,
                 params: Any) -> None:
        self.response_id, self.owners, self.method, self.params = (
            response_id, owners, method, params)

    async def call(self, fwd: Attempt) -> Call:
        return Call(f"/v1/responses/{quote(self.response_id, safe='')}", b"",
                    params=self.params, method=self.method, json_body=False)

    def whole(self, fwd: Attempt, answer: Answer, data: bytes) -> web.StreamResponse:
        if self.method == hdrs.METH_DELETE and answer.status < 300:
            self.owners.forget(self.response_id)
        headers = response_headers(answer.headers)
        if self.method == hdrs.METH_HEAD and hdrs.CONTENT_LENGTH in answer.headers:
            headers[hdrs.CONTENT_LENGTH] = answer.headers[hdrs.CONTENT_LENGTH]
        return web.Response(body=data, status=answer.status, headers=headers)


async def stored(request: web.Request) -> web.StreamResponse:
    """GET, HEAD or DELETE /v1/responses/{id}: sent to the slot whose model made the answer.
    A HEAD is answered as its GET would be, without the body: the upstream's status and headers,
    its Content-Length included."""
    response_id = request.match_info["id"]
    owners = request.app[RESPONSE_OWNERS]
    owner = owners.owner(response_id)
    if owner is None:
        raise NoRoute(
            f"no response {response_id!r} is known to hal0d: it was not made through it, or "
            "is older than the last few thousand answers it remembers"
        )
    exchange = Stored(response_id, owners, request.method, request.query)
    return await request.app[DISPATCH].serve(request, owner.model, exchange, slot=owner.slot)
