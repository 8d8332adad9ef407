"""Reading and checking request bodies, the same way on every surface."""

from __future__ import annotations

import asyncio
import email.parser
import email.policy
from typing import Any

import orjson
from aiohttp import hdrs, web

from hal0d.errors import InvalidRequest, PayloadTooLarge


async def read_body(request: web.Request) -> bytes:
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLarge(
            f"request body is larger than server.max_body_bytes ({request.client_max_size} bytes)"
        ) from None


def parse_json_object(body: bytes) -> dict[str, Any]:
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        reason = (
            "is not valid UTF-8" if "utf-8" in str(exc).lower() else f"is not valid JSON ({exc})"
        )
        raise InvalidRequest(f"request body {reason}") from None
    if not isinstance(parsed, dict):
        raise InvalidRequest(f"request body must be a JSON object, not {type(parsed).__name__}")
    return parsed


def check_model_and_stream(payload: dict[str, Any], field_label: str) -> tuple[str, bool]:
    """The two fields every surface must get right before a slot is taken (the upstream judges
    the rest). `field_label` names a field in the surface's own wording: "'{}'" (OpenAI),
    "{}:" (Anthropic)."""
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest(
            f"{field_label.format('model')} is required and must be a non-empty string",
            field="model",
        )
    stream = payload.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidRequest(f"{field_label.format('stream')} must be a boolean", field="stream")
    return model, stream


# Bodies larger than this are parsed in a worker thread: a 20 MiB upload takes ~0.6 s to parse,
# which must not stall every stream the event loop is relaying.
PARSE_IN_THREAD_BYTES = 256 * 1024


async def multipart_field(request: web.Request, body: bytes, name: str) -> str | None:
    """One text field of a multipart/form-data body (the `model` of a transcription)."""
    content_type = request.headers.get(hdrs.CONTENT_TYPE, "")
    if len(body) <= PARSE_IN_THREAD_BYTES:
        return _multipart_field(content_type, body, name)
    return await asyncio.to_thread(_multipart_field, content_type, body, name)


def _multipart_field(content_type: str, body: bytes, name: str) -> str | None:
    head = f"Content-Type: {content_type}\r\n\r\n".encode("latin-1", "replace")
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + body)
    if not message.is_multipart():
        raise InvalidRequest("request body must be multipart/form-data")
    for part in message.iter_parts():
        if part.get_param("name", header="content-disposition") == name:
            payload = part.get_payload(decode=True)
            if isinstance(payload, bytes):
                return payload.decode("utf-8", "replace").strip()
    return None


def replace_multipart_field(body: bytes, name: str, old: str, new: str) -> bytes:
    """`body` with the value of its text field `name` changed from `old` to `new`, every other
    byte (the audio above all) left as it was. Unchanged when the field is not found as such."""
    head = f'name="{name}"'.encode()
    start = body.find(head)
    if start < 0:
        return body
    value_at = body.find(b"\r\n\r\n", start)
    if value_at < 0:
        return body
    value_at += 4
    end = body.find(b"\r\n--", value_at)
    if end < 0 or body[value_at:end].strip() != old.encode():
        return body
    return body[:value_at] + new.encode() + body[end:]
