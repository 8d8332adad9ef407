"""The OpenAI surface: POST /v1/<endpoint> (and /llm/v1/<endpoint>) dispatched to a slot.

The request is checked here and handed to the forward path (hal0d/forward/) as an exchange that
passes the answer on as it came: the forward path opens the upstream eagerly (so a dead upstream
is a clean 502) and relays the answer byte for byte.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
from aiohttp import web

from hal0d import conversations
from hal0d.appkeys import DISPATCH
from hal0d.errors import InvalidRequest
from hal0d.forward import Answer, Attempt, Call, Dispatch, Exchange
from hal0d.forward.context_guard import ContextNeed
from hal0d.handlers.body import (
    check_model_and_stream,
    multipart_field,
    parse_json_object,
    read_body,
    replace_multipart_field,
)
from hal0d.keys import KEY
from hal0d.observability.requestinfo import INFO, client_of
from hal0d.openai.transform import Passthrough
from hal0d.protocol.limits import MAX_MESSAGES, MAX_TOKENS_LIMIT
from hal0d.protocol.transform import Transform
from hal0d.routing import Plan, best
from hal0d.transport.upstream import response_headers

ENDPOINTS = (
    "chat/completions",
    "completions",
    "embeddings",
    "audio/speech",
    "audio/transcriptions",
    "images/generations",
    "rerank",
)
# Endpoints whose answer is a byte stream even without `"stream": true`.
ALWAYS_STREAMING = frozenset({"audio/speech"})
# Endpoints whose stream is SSE.
SSE_ENDPOINTS = frozenset({"chat/completions", "completions"})
OPENAI_FIELD = "'{}'"  # how the OpenAI surface names a field in an error message


def check_fields(endpoint: str, payload: dict[str, Any]) -> None:
    """Reject what no upstream could serve, in hal0d's envelope, before a slot is taken.

    Only the fields every OpenAI-compatible server reads the same way; the rest is the
    upstream's to judge, and its 4xx is relayed verbatim.
    """
    for name in ("max_tokens", "max_completion_tokens"):
        value = payload.get(name)
        if value is not None and (type(value) is not int or not 1 <= value <= MAX_TOKENS_LIMIT):
            raise InvalidRequest(
                f"'{name}' must be an integer from 1 to {MAX_TOKENS_LIMIT}, not {value!r}",
                field=name,
            )
    for name in ("temperature", "top_p"):
        value = payload.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise InvalidRequest(f"'{name}' must be a number", field=name)
    options = payload.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise InvalidRequest("'stream_options' must be an object", field="stream_options")
    if endpoint != "chat/completions":
        return
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty array", field="messages")
    if len(messages) > MAX_MESSAGES:
        raise InvalidRequest(f"'messages' holds more than {MAX_MESSAGES} items", field="messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequest(
                "each message must be an object with a string 'role'", field=f"messages.{index}"
            )


async def requested_model(request: web.Request, endpoint: str, body: bytes
                          ) -> tuple[str, bool, str, str | None, object]:
    """The model name, whether the client asked for a stream, whose turn it waits for
    (client_of), the conversation it continues (conversations.py) and the answer's max tokens.
    The parsed body is not kept: a long conversation's parse tree would live as long as the
    stream, where the body's bytes are all the attempts need."""
    if endpoint == "audio/transcriptions":
        model = await multipart_field(request, body, "model")
        if not model:
            raise InvalidRequest("multipart field 'model' is required", field="model")
        return model, False, client_of(request[INFO], None), None, None
    payload = parse_json_object(body)
    model, stream = model_and_stream(payload)
    check_fields(endpoint, payload)
    conversation = (conversations.of_chat(request.headers, payload)
                    if endpoint in ("chat/completions", "completions") else None)
    answer = payload.get("max_completion_tokens", payload.get("max_tokens"))
    return model, stream, client_of(request[INFO], payload), conversation, answer


def model_and_stream(payload: dict[str, Any]) -> tuple[str, bool]:
    """The two fields every OpenAI-shaped body (chat, completions, Responses) must get right
    before a slot is taken."""
    return check_model_and_stream(payload, OPENAI_FIELD)


def with_model(body: bytes, served_model: str) -> bytes:
    payload: dict[str, Any] = orjson.loads(body)
    payload["model"] = served_model
    return orjson.dumps(payload)


class Relayed(Exchange):
    """An OpenAI request at the slot's same endpoint, its answer passed on as it came: each slot
    gets the body as the client sent it, its own model name in it."""

    __slots__ = ("body", "endpoint", "max_tokens", "model", "params", "sse", "stream")

    def __init__(self, endpoint: str, body: bytes, model: str, *, stream: bool,
                 params: Any, max_tokens: object = None) -> None:
        self.endpoint, self.body, self.model, self.params = endpoint, body, model, params
        self.stream = stream or endpoint in ALWAYS_STREAMING
        self.sse = endpoint in SSE_ENDPOINTS
        self.max_tokens = max_tokens

    def need(self) -> ContextNeed | None:
        """A chat completion's prompt and answer, measured against the slot's context (the
        body parsed again only near the limit)."""
        if self.endpoint != "chat/completions":
            return None
        return ContextNeed.of_body(self.body, self.max_tokens, lambda: orjson.loads(self.body))

    async def call(self, fwd: Attempt) -> Call:
        served_model = fwd.route.served_model
        sent = self.body
        if served_model != self.model:
            if self.endpoint == "audio/transcriptions":
                sent = replace_multipart_field(sent, "model", self.model, served_model)
            else:
                sent = with_model(sent, served_model)
        # Parsed as JSON: said so even when the client did not (`curl -d` sends a form
        # content-type, which strict upstreams such as llama-cpp-python refuse).
        return Call(f"/v1/{self.endpoint}", sent, params=self.params,
                    json_body=self.endpoint != "audio/transcriptions")

    def relay(self, fwd: Attempt, answer: Answer) -> tuple[Mapping[str, str], Transform]:
        sse = answer.content_type == "text/event-stream"
        return response_headers(answer.headers), Passthrough(
            sse=sse, legacy_completion=self.endpoint == "completions", model=self.model,
            expect_done=sse)


async def dispatch(request: web.Request) -> web.StreamResponse:
    endpoint = request.match_info["endpoint"]
    body = await read_body(request)
    model, stream, client, conversation, answer = await requested_model(request, endpoint, body)
    exchange = Relayed(endpoint, body, model, stream=stream, params=request.query,
                       max_tokens=answer)
    return await request.app[DISPATCH].serve(request, model, exchange, client=client,
                                             conversation=conversation)


async def list_models(request: web.Request) -> web.Response:
    """Every model the key may use, loaded or not; `state` tells a client whether the first
    request will load it. A route's is its best slot's (routing.best: ready or serving, then
    starting, stopped, error), and `owned_by` names that slot, so a route whose first box is
    down but whose second answers is listed as the second, ready."""
    dispatch = request.app[DISPATCH]
    data = []
    for plan in dispatch.runtime.current.router.listed(request.get(KEY)):
        shown, state = best(dispatch.order(plan), dispatch.state_of)
        entry: dict[str, Any] = {"id": plan.model, "object": "model", "created": 0,
                                 "owned_by": shown.slot.name, "state": state}
        if plan.route is not None:
            entry["slots"] = list(plan.route.slots)
        if (context := await longest_context(dispatch, plan)) is not None:
            # The most a request may use (a route sends a long prompt where it fits), under
            # the name clients of vLLM read too.
            entry["context_length"] = entry["max_model_len"] = context
        data.append(entry)
    return web.json_response({"object": "list", "data": data})


async def longest_context(dispatch: Dispatch, plan: Plan) -> int | None:
    """The longest context among the plan's slots (forward/contexts.py); None: none known."""
    if dispatch.contexts is None:
        return None
    known = [context.tokens for route in plan.routes
             if (context := await dispatch.contexts.of(route.slot)) is not None]
    return max(known) if known else None
