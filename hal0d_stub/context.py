"""The context a completion must fit, and how the stub's model server refuses a prompt past it.

Played as llama-server (the default), each server slot holds ctx_size // parallel tokens (its
KV cache split among the slots, as llama-server does without --kv-unified). A prompt of that
many tokens or more is refused before any of it is read, with HTTP 400 and llama-server's own
body (server-context.cpp's ERROR_TYPE_EXCEED_CONTEXT_SIZE, captured in
tests/fixtures/llama-server/exceed-context.json): on every completion endpoint, streamed or
not, since the refusal comes before any stream would begin. A prompt that fits is answered
until the context is full: prompt and answer together stop at n_ctx with finish_reason
"length", whatever max_tokens asked (llama-server's context shift is off by default).

Played as vLLM (`--max-model-len N`), the prompt and the answer's max_tokens together must fit
N, checked before anything else (vLLM's OpenAI server's _validate_prompt_and_tokenize); a
request without max_tokens may have a prompt of up to N - 1 tokens and an answer to the end.
The refusal is a 400 in that server's error envelope (`{"object": "error", "message", "type":
"BadRequestError", "param": null, "code": 400}`), and, at /v1/messages, the same message in the
Anthropic envelope vLLM's Messages router wraps its errors in.

The stub's GET /props (`--props FILE`) tells its own n_ctx, so what it says and what it refuses
agree; started with --props and no --ctx-size, it takes the context the file names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

LLAMA_CTX_SIZE = 4096  # the stub's --ctx-size when neither it nor a --props file names one


def refused(body: dict[str, Any]) -> web.Response:
    """A 400 with `body` as the servers write it: compact JSON, charset named."""
    return web.Response(text=orjson.dumps(body).decode(), status=400,
                        content_type="application/json")


def exceed_context_size(n_prompt_tokens: int, n_ctx: int) -> dict[str, Any]:
    """llama-server's body for a prompt past its slot's context, its keys in its order."""
    return {"error": {
        "code": 400,
        "message": (f"request ({n_prompt_tokens} tokens) exceeds the available context size "
                    f"({n_ctx} tokens), try increasing it"),
        "type": "exceed_context_size_error",
        "n_prompt_tokens": n_prompt_tokens,
        "n_ctx": n_ctx,
    }}


def vllm_too_long(prompt: int, max_tokens: int | None, max_model_len: int) -> str:
    """vLLM's words for a request past max_model_len: with max_tokens, the sum; without it, the
    prompt alone (its sentence as vLLM writes it, comma and all)."""
    head = f"This model's maximum context length is {max_model_len} tokens. However, you requested "
    if max_tokens is None:
        return head + (f"{prompt} tokens in the messages, Please reduce the length of the "
                       "messages.")
    return head + (f"{prompt + max_tokens} tokens ({prompt} in the messages, {max_tokens} in the "
                   "completion). Please reduce the length of the messages or completion.")


def asked_max_tokens(body: dict[str, Any], *names: str) -> int | None:
    """The request's limit on its answer: the first of `names` it sets to a positive number."""
    for name in names or ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if type(value) is int and value > 0:
            return value
    return None


@dataclass(frozen=True)
class ContextLimit:
    """What one completion may hold: llama-server's per-slot n_ctx, or vLLM's max_model_len
    when the stub plays vLLM."""

    n_ctx: int
    max_model_len: int | None = None

    def room(self, prompt: int) -> int:
        """How many tokens an answer to a prompt that fits may have: the rest of the context."""
        return (self.max_model_len or self.n_ctx) - prompt

    def refusal(self, prompt: int, max_tokens: int | None, *,
                anthropic: bool = False) -> web.Response | None:
        """The server's 400 when `prompt` (and, for vLLM, `max_tokens`) does not fit, else
        None. `anthropic`: the request came to /v1/messages."""
        if self.max_model_len is None:
            if prompt < self.n_ctx:
                return None
            return refused(exceed_context_size(prompt, self.n_ctx))
        fits = (prompt < self.max_model_len if max_tokens is None
                else prompt + max_tokens <= self.max_model_len)
        if fits:
            return None
        message = vllm_too_long(prompt, max_tokens, self.max_model_len)
        if anthropic:
            return refused({"type": "error", "error": {"type": "BadRequestError",
                                                       "message": message}})
        return refused({"object": "error", "message": message, "type": "BadRequestError",
                        "param": None, "code": 400})


def props_context(props: dict[str, Any] | None) -> int | None:
    """The n_ctx a GET /props answer names (default_generation_settings.n_ctx), if any."""
    settings = (props or {}).get("default_generation_settings")
    n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
    return n_ctx if type(n_ctx) is int and n_ctx > 0 else None


def ctx_size(given: int | None, props: dict[str, Any] | None, parallel: int) -> int:
    """The stub's --ctx-size: as given, else what its --props file says each of its slots
    holds, else LLAMA_CTX_SIZE."""
    if given is not None:
        return given
    described = props_context(props)
    return described * parallel if described is not None else LLAMA_CTX_SIZE


def with_n_ctx(props: dict[str, Any], n_ctx: int) -> dict[str, Any]:
    """`props` telling `n_ctx` as its slots' context, whatever the file said."""
    settings = props.get("default_generation_settings")
    settings = dict(settings) if isinstance(settings, dict) else {}
    return {**props, "default_generation_settings": {**settings, "n_ctx": n_ctx}}
