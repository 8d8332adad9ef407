"""What a request is charged when it ends: the tokens counted against its key, in its share of
the box (shares/book.py) and its quotas (shares/quotas.py).

The tokens are the prompt and the generated ones as the answer's usage counts them; a server that
gives no usage is charged an estimate (the prompt's bytes / 4, which the context guard's count
replaces when it made one). A request that never had an answer begun (refused, failed before its
upstream answered) is charged nothing. A stream that crossed its key's quota is charged whole:
it was let finish.
"""

from __future__ import annotations

from hal0d.observability.requestinfo import RequestInfo

BYTES_PER_TOKEN = 4  # what a tokenizer makes of English text, about
COUNT_TOKENS = "/count_tokens"  # Anthropic's /v1/messages/count_tokens (and under /llm)


def charge_of(info: RequestInfo, body_bytes: int | None) -> int | None:
    """The tokens `info`'s request is charged; None when it is charged nothing (a count of a
    prompt's tokens generates nothing: Claude Code asks for one before many of its turns)."""
    if info.slot is None or info.endpoint.endswith(COUNT_TOKENS):
        return None
    prompt, completion = info.prompt_tokens, info.completion_tokens
    if info.usage is None and info.ttft_ms is None and info.status != 200:
        return None  # no answer began: whatever was counted of its prompt was not used
    if prompt is None:
        prompt = (body_bytes or 0) // BYTES_PER_TOKEN
    return prompt + (completion or 0)
