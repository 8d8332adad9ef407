"""The audio and image endpoints: /v1/audio/speech (a stream of audio frames, in which `stall`,
`broken` and `chatty` misbehave as in a stream of tokens), /v1/audio/transcriptions (OpenAI's
multipart upload; `response_format` json or text) and /v1/images/generations (a tiny real PNG).
"""

from __future__ import annotations

import base64
import itertools
import struct
import time
import zlib

import orjson
from aiohttp import hdrs, web

from hal0d_stub.answering import (
    MID_STREAM_TROUBLE,
    TOKENS_BEFORE_TROUBLE,
    answer_whole,
    misbehave_mid_stream,
    pause,
)
from hal0d_stub.appkeys import DELAY_KEY
from hal0d_stub.handling import bad_request, logged, read_json

TRANSCRIPT_TEXT = "Hello from the hal0d stub. This is what the audio said."


@logged("speech")
async def speech(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    model = str(body.get("model", ""))
    response = web.StreamResponse(headers={hdrs.CONTENT_TYPE: "audio/wav"})
    await response.prepare(request)
    frames = itertools.count() if model == "chatty" else range(8)
    for index in frames:
        await pause(request.app[DELAY_KEY])
        await response.write(bytes([index % 256]) * 1024)
        if (
            model in MID_STREAM_TROUBLE
            and index + 1 >= TOKENS_BEFORE_TROUBLE
            and await misbehave_mid_stream(request, model, f"frame={index}")
        ):
            return response
    await response.write_eof()
    return response


def tiny_png(width: int = 8, height: int = 8) -> bytes:
    """A real PNG, a grey gradient: small, the same every time, and decodable by any viewer."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data)))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit greyscale
    rows = b"".join(
        b"\x00" + bytes((x + y) * 255 // (width + height - 2) for x in range(width))
        for y in range(height)
    )
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


PNG_B64 = base64.b64encode(tiny_png()).decode("ascii")
MAX_IMAGES = 10


@logged("images")
async def images(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise bad_request("'prompt' is required and must be a non-empty string")
    n = body.get("n", 1)
    if type(n) is not int or not 1 <= n <= MAX_IMAGES:
        raise bad_request(f"'n' must be an integer from 1 to {MAX_IMAGES}")
    if body.get("response_format", "b64_json") == "url":
        # The stub hosts no files: a data URL is a URL every client can open.
        image: dict[str, str] = {"url": f"data:image/png;base64,{PNG_B64}"}
    else:
        image = {"b64_json": PNG_B64}
    answer = {"created": int(time.time()), "data": [dict(image, revised_prompt=prompt)] * n}
    return await answer_whole(request, str(body.get("model", "")), orjson.dumps(answer))


@logged("transcriptions")
async def transcriptions(request: web.Request) -> web.StreamResponse:
    """OpenAI's multipart upload: the `file`, `model` and `response_format` (json or text)."""
    try:
        form = await request.post()
    except ValueError:
        raise bad_request("body must be multipart/form-data") from None
    upload = form.get("file")
    if not isinstance(upload, web.FileField):
        raise bad_request("multipart field 'file' (the audio) is required")
    audio = upload.file.read()
    model = str(form.get("model", ""))
    text = f"{TRANSCRIPT_TEXT} ({len(audio)} bytes of {upload.content_type})"
    response_format = str(form.get("response_format", "json"))
    if response_format == "text":
        return await answer_whole(request, model, text.encode(), "text/plain")
    if response_format != "json":
        raise bad_request(f"response_format {response_format!r}: the stub serves json or text")
    return await answer_whole(request, model, orjson.dumps({"text": text}))
