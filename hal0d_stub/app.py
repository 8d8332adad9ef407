"""The stub upstream: an OpenAI-compatible server for the demo, the tests and the benchmark.

It serves every endpoint hal0d dispatches, with small deterministic answers in the shapes the
real servers use: chat completions and completions (streamed and not), embeddings, audio speech
(a byte stream) and transcriptions (multipart; `response_format` json or text), image generations
(a tiny real PNG as `b64_json`), rerank (llama-server's and Jina's shape), llama-server's
/tokenize and /apply-template (a ChatML template with a default system prompt, which its usage
counts too, as a real server's does), the Responses API (/v1/responses, streamed as named events,
kept for GET and DELETE), and, made with `anthropic_native` (`hal0d stub --anthropic-native`),
the Anthropic Messages API natively. Chat completions stream SSE the way llama-server does (a
role-only first chunk, one chunk per token, a final chunk with finish_reason, a usage chunk when
`stream_options.include_usage` is set, `timings` on the last chunk, `data: [DONE]`). Both
completions run on llama-server's server slots and their prompt cache (slots.py: `--parallel`,
`id_slot`, `cache_prompt`, `timings`, `usage.prompt_tokens_details.cached_tokens`, a prefill paced
by the uncached tokens), with its GET /slots and POST /slots/{id}?action=save|restore|erase
(slot_api.py). Made with `props`, it describes itself at GET /props as llama-server does (the
tests hand it a capture of the real one), its n_ctx the one its slots hold. A prompt that does
not fit that context is refused as llama-server refuses it, and an answer stops where the context
is full (context.py); made with `max_model_len`, the stub checks as vLLM does instead.

It misbehaves on demand through the model name, on every endpoint, streamed or not:

    reasoning   reasoning_content tokens, then content tokens ("long" as the last user message:
                content until max_tokens)
    chat        content only          think-only  reasoning_content only
    tool        calls the first tool of the request (arguments streamed in fragments)
    shell       an agent's turn: asks for a shell command (SHELL_COMMAND) through the request's
                shell tool (Codex's exec_command, shell_command, shell or local_shell; else the
                first tool), and once the conversation ends with that tool's result, answers
                "The command printed: <the result>"
    stall       streamed: a few tokens (or audio frames), then silence with the connection open;
                not streamed: no answer at all, the connection left open
    chatty      streamed: content (or audio) forever, finish_reason always null;
                not streamed: never answers, since the answer never ends
    broken      streamed: a few tokens, then the connection is cut; not streamed: the headers and
                half the body, then the connection is cut

Only chat completions refuse a model name outside that list (404); the other endpoints answer any
name. Every error is JSON in OpenAI's envelope, unknown paths and oversized bodies included.

Each request appends lines to --log: `start`, then `end` or `cancelled` (the client went away
before the answer was complete), with `stalling` or `breaking` in between when the model asks for
it, and `slot-select` (the server slot a completion took, why, its cache_n and prompt_n); each
slot action one line (`slot-save`, `slot-restore`, `slot-erase`): the tests and the README's
commands read them.

This module is the app (its routes) and the process `hal0d stub` runs; the rest is a module per
concern: models.py (the model names and what each one says), prompt.py (the chat template and
the tokenizer; /tokenize, /apply-template), completions.py, generation.py and
completion_stream.py (chat and text completions: the endpoints, the answer, its stream),
responses_api.py, anthropic_native.py, media.py (audio, images), retrieval.py (embeddings,
rerank), handling.py (the JSON body, errors, the log lines), answering.py (the answer sent, or
the misbehaviour in its place), appkeys.py (what the app keeps for its handlers).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from aiohttp import web

from hal0d_stub.anthropic_native import native_count_tokens, native_messages
from hal0d_stub.appkeys import ALIASES_KEY, CONTEXT_KEY, DELAY_KEY, LOG_KEY, SLOTS_KEY, StubLog
from hal0d_stub.completions import chat_completions, completions
from hal0d_stub.context import ContextLimit, ctx_size, with_n_ctx
from hal0d_stub.device_load import DeviceLoad, claim
from hal0d_stub.handling import json_errors
from hal0d_stub.media import images, speech, transcriptions
from hal0d_stub.models import models
from hal0d_stub.prompt import template, tokenize
from hal0d_stub.responses_api import RESPONSES_KEY, responses, stored_response
from hal0d_stub.retrieval import embeddings, rerank
from hal0d_stub.slot_api import SlotApi
from hal0d_stub.slots import ServerSlots, SlotOptions

# hal0d accepts request bodies up to its largest [server].max_body_bytes (4 GiB): the stub takes
# as much, so every body hal0d lets through reaches an upstream that answers it, instead of
# aiohttp's default 1 MiB refusing it with a 413 that reads as hal0d's own failure.
MAX_BODY_BYTES = 1 << 32


def make_stub_app(
    log_path: Path | None = None, delay: float = 0.02, *, anthropic_native: bool = False,
    chat_only: bool = False, slot_options: SlotOptions | None = None,
    props: dict[str, Any] | None = None, aliases: tuple[str, ...] = (),
    max_model_len: int | None = None,
) -> web.Application:
    """`anthropic_native`: also serve /v1/messages (and count_tokens) as llama-server does;
    without it those paths answer 404, like llama-cpp-python's server. `chat_only`: no
    /v1/responses (a 404), as llama-cpp-python's server and older vLLM. `slot_options`: the
    server slots' (one slot, no --slot-save-path, an instant prefill by default; without them,
    the context `props` names, else 4096). `props`: what GET /props answers, as llama-server
    describes itself (without it a 404, as vLLM), its n_ctx the slots' own. `aliases`:
    llama-server's --alias names (see `complete`, completions.py). `max_model_len`: the stub
    plays vLLM's context check instead of llama-server's (context.py)."""
    app = web.Application(middlewares=[json_errors], client_max_size=MAX_BODY_BYTES)
    app[ALIASES_KEY] = tuple(sorted(aliases))
    app[LOG_KEY] = StubLog(log_path)
    app[DELAY_KEY] = delay
    app[RESPONSES_KEY] = {}
    slot_options = slot_options or SlotOptions(ctx_size=ctx_size(None, props, 1))
    n_ctx = slot_options.ctx_size // slot_options.parallel
    app[CONTEXT_KEY] = ContextLimit(n_ctx, max_model_len)
    app[SLOTS_KEY] = ServerSlots(slot_options, app[LOG_KEY].write)
    slot_api = SlotApi(app[SLOTS_KEY], app[LOG_KEY].write)
    app.router.add_get("/slots", slot_api.list_slots)
    app.router.add_post("/slots/{id_slot}", slot_api.act)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/audio/speech", speech)
    app.router.add_post("/v1/audio/transcriptions", transcriptions)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/v1/images/generations", images)
    app.router.add_post("/v1/rerank", rerank)
    if not chat_only:
        app.router.add_post("/v1/responses", responses)
        app.router.add_get("/v1/responses/{id}", stored_response)
        app.router.add_delete("/v1/responses/{id}", stored_response)
    if anthropic_native:
        app.router.add_post("/v1/messages", native_messages)
        app.router.add_post("/v1/messages/count_tokens", native_count_tokens)
    if props is not None:
        described = with_n_ctx(props, n_ctx)

        async def self_description(request: web.Request) -> web.Response:
            app[LOG_KEY].write("props")
            return web.json_response(described)

        app.router.add_get("/props", self_description)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/apply-template", template)

    async def close_log(app: web.Application) -> None:
        app[LOG_KEY].close()

    app.on_cleanup.append(close_log)
    return app


def run_stub(
    host: str,
    port: int,
    log_path: Path | None,
    delay: float,
    *,
    startup_delay: float = 0.0,
    fail_start: str | None = None,
    anthropic_native: bool = False,
    chat_only: bool = False,
    slot_options: SlotOptions | None = None,
    props: dict[str, Any] | None = None,
    aliases: tuple[str, ...] = (),
    device_load: DeviceLoad | None = None,
    max_model_len: int | None = None,
) -> int:
    """Serve until stopped. `startup_delay`: seconds before listening, as a model server loads its
    weights first. `fail_start`: after the delay, print this line and exit 1 instead of serving,
    as a model server does when its model file is missing or does not fit. `anthropic_native`:
    also serve the Anthropic Messages API, as llama-server does; `chat_only`: serve no
    Responses API, as llama-cpp-python's server. `slot_options`: its server slots'; a
    --slot-save-path that is not a directory is refused at once, as llama-server refuses it.
    `props`: what GET /props answers (--props); `aliases`: llama-server's --alias names.
    `device_load`: its footprint on the simulated GPU box, taken as it loads (device_load.py);
    when it does not fit, llama-server's out-of-memory lines and exit 1. `max_model_len`:
    vLLM's context check in place of llama-server's (--max-model-len)."""
    save_path = slot_options.save_path if slot_options else None
    if save_path is not None and not save_path.is_dir():
        print(f"stub: --slot-save-path: not a directory: {save_path}", file=sys.stderr,
              flush=True)
        return 1
    if device_load is not None and not claim(device_load):
        return 1
    if startup_delay > 0:
        print(f"stub: loading for {startup_delay:g} s", flush=True)
        time.sleep(startup_delay)
    if fail_start is not None:
        print(fail_start, file=sys.stderr, flush=True)
        return 1
    web.run_app(
        make_stub_app(log_path, delay, anthropic_native=anthropic_native, chat_only=chat_only,
                      slot_options=slot_options, props=props, aliases=aliases,
                      max_model_len=max_model_len),
        host=host,
        port=port,
        handler_cancellation=True,
        access_log=None,
        print=None,
    )
    return 0
