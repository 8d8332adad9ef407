"""An upstream's own refusal of a prompt its context cannot hold, read as hal0d's ContextExceeded
(pure: the error body's bytes in, the error or None out), so that a client hears it in its own
API's words whichever server said it, and the history records it as context_exceeded.

    llama-server   {"error": {"type": "exceed_context_size_error", "n_prompt_tokens": P,
                   "n_ctx": N, "message": "request (P tokens) exceeds the available context
                   size (N tokens), try increasing it", ...}}; its figures are read from the
                   fields, else from the words (also "input (P tokens) is larger than the max
                   context size (N tokens)", the refusal of a prompt it cannot split)
    vLLM, older    {"object": "error", "message": "This model's maximum context length is N
                   tokens. However, you requested P+T tokens (P in the messages, T in the
                   completion). ..."}, or without max_tokens "... you requested P tokens in
                   the messages, ..."
    vLLM, newer    {"error": {"message": "This model's maximum context length is N tokens.
                   However, your request has P input tokens. ..."}}, and "'max_tokens' or
                   'max_completion_tokens' is too large: T. This model's maximum context length
                   is N tokens and your request has P input tokens (T > N - P)."
    OpenAI's own   "This model's maximum context length is N tokens. However, your messages
                   resulted in P tokens" (hal0d's own words too, "(P+T with the T of max_tokens
                   ...)" when max_tokens overflowed it)
    Anthropic's    "prompt is too long: P tokens > N maximum"

The message is found wherever the server puts it (errors.upstream_message: OpenAI's envelope,
vLLM's flat one, Anthropic's). Where the server tells the prompt apart from the answer's
max_tokens, both are kept, so the Anthropic surface can say which one overflowed. The figures are
the upstream's own: its tokenizer and its template counted them.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from hal0d.errors import ContextExceeded, upstream_message

__all__ = ["context_exceeded"]

LLAMA_TYPE = "exceed_context_size_error"
# Words every recognised body holds: a 400 without any of them is not parsed at all.
_HINTS = (b"context", b"too long")
# The servers' sentences, the most particular first; each names the prompt and the context, and
# some the answer's max_tokens.
_SENTENCES = tuple(re.compile(pattern) for pattern in (
    r"'max_tokens' or 'max_completion_tokens' is too large: (?P<max_tokens>\d+)\. This model's "
    r"maximum context length is (?P<context>\d+) tokens and your request has (?P<prompt>\d+) "
    r"input tokens",
    r"maximum context length is (?P<context>\d+) tokens\. However, you requested \d+ tokens "
    r"\((?P<prompt>\d+) in the messages, (?P<max_tokens>\d+) in the completion\)",
    r"maximum context length is (?P<context>\d+) tokens\. However, (?:you requested|your request "
    r"has|your messages resulted in) (?P<prompt>\d+) (?:input )?tokens"
    r"(?: \(\d+ with the (?P<max_tokens>\d+) of max_tokens)?",
    r"request \((?P<prompt>\d+) tokens\) exceeds the available context size "
    r"\((?P<context>\d+) tokens\)",
    r"input \((?P<prompt>\d+) tokens\) is larger than the max context size "
    r"\((?P<context>\d+) tokens\)",
    r"prompt is too long: (?P<prompt>\d+) tokens > (?P<context>\d+) maximum",
))


def context_exceeded(data: bytes) -> ContextExceeded | None:
    """The upstream's error body as ContextExceeded when it says the prompt does not fit its
    context (in any of the servers' words above), else None."""
    if not any(hint in data for hint in _HINTS):
        return None
    try:
        body = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    if (found := _llama_fields(body)) is not None:
        return found
    message = upstream_message(body)
    if message is None:
        return None
    for sentence in _SENTENCES:
        if (match := sentence.search(message)) is not None:
            prompt, context = int(match["prompt"]), int(match["context"])
            if prompt <= 0 or context <= 0:
                return None
            max_tokens = match.groupdict().get("max_tokens")
            return ContextExceeded(prompt, context, int(max_tokens) if max_tokens else None)
    return None


def _llama_fields(body: Any) -> ContextExceeded | None:
    """llama-server's own figures, beside its words."""
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or error.get("type") != LLAMA_TYPE:
        return None
    prompt, context = error.get("n_prompt_tokens"), error.get("n_ctx")
    if type(prompt) is int and type(context) is int and prompt > 0 and context > 0:
        return ContextExceeded(prompt, context)
    return None
