"""The retrieval endpoints: /v1/embeddings (the same vector for the same text, every time) and
/v1/rerank (llama-server's shape, which Jina and Cohere clients read too), both deterministic so
a test knows what the answer must be.
"""

from __future__ import annotations

import hashlib
import uuid
from typing import Any

import orjson
from aiohttp import web

from hal0d_stub.answering import answer_whole
from hal0d_stub.handling import bad_request, logged, read_json


def unit_vector(text: str, size: int = 8) -> list[float]:
    """The same text always gets the same embedding (sha256, not the salted built-in hash)."""
    digest = hashlib.sha256(text.encode()).digest()
    return [round(byte / 255, 4) for byte in digest[:size]]


@logged("embeddings")
async def embeddings(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    inputs = body.get("input")
    items = inputs if isinstance(inputs, list) else [inputs]
    data = [
        {"object": "embedding", "index": i, "embedding": unit_vector(str(item))}
        for i, item in enumerate(items)
    ]
    answer = {
        "object": "list", "data": data, "model": body.get("model"),
        "usage": {"prompt_tokens": len(items), "total_tokens": len(items)},
    }
    return await answer_whole(request, str(body.get("model", "")), orjson.dumps(answer))


def relevance(query: str, document: str) -> float:
    """The share of the query's words the document holds: deterministic, and it ranks."""
    asked = set(query.lower().split())
    held = set(document.lower().split())
    return round(len(asked & held) / len(asked), 4) if asked else 0.0


def document_text(document: Any) -> str | None:
    if isinstance(document, str):
        return document
    if isinstance(document, dict) and isinstance(document.get("text"), str):
        return str(document["text"])
    return None


@logged("rerank")
async def rerank(request: web.Request) -> web.StreamResponse:
    """llama-server's /v1/rerank, which Jina and Cohere clients also read: results ordered by
    relevance_score, the best first, `top_n` of them; `return_documents` adds each text."""
    body = await read_json(request)
    query, documents = body.get("query"), body.get("documents")
    if not isinstance(query, str) or not query:
        raise bad_request("'query' is required and must be a non-empty string")
    texts = [document_text(d) for d in documents] if isinstance(documents, list) else []
    if not texts or any(text is None for text in texts):
        raise bad_request("'documents' must be a non-empty array of strings or {text} objects")
    top_n = body.get("top_n", len(texts))
    if type(top_n) is not int or top_n < 1:
        raise bad_request("'top_n' must be a positive integer")
    scored = sorted(
        ((index, relevance(query, str(text))) for index, text in enumerate(texts)),
        key=lambda item: (-item[1], item[0]),
    )[:top_n]
    results: list[dict[str, Any]] = []
    for index, score in scored:
        result: dict[str, Any] = {"index": index, "relevance_score": score}
        if body.get("return_documents"):
            result["document"] = {"text": texts[index]}
        results.append(result)
    tokens = len(query.split()) + sum(len(str(text).split()) for text in texts)
    answer = {
        "id": f"rerank-{uuid.uuid4().hex[:24]}", "object": "list",
        "model": body.get("model"), "results": results,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    return await answer_whole(request, str(body.get("model", "")), orjson.dumps(answer))
