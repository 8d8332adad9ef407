"""llama-server's slot endpoints on the stub: GET /slots, and POST /slots/{id_slot}?action=
save|restore|erase with {"filename": ...} (erase takes no body).

The answers, refusals included, are llama-server's (server-context.cpp and server.cpp of the
llama.cpp this stub follows), checked in its order:

    no --slot-save-path                 501 not_supported_error  (every action, erase too)
    id_slot not a number                400 "Invalid slot ID"    (parsed as std::stoi does)
    action not save|restore|erase       400 "Invalid action"
    body not JSON / no string filename  500 server_error, nlohmann::json's exception text
    a filename it refuses (fs_validate_filename: a path separator, "..", a trailing dot ...)
                                        400 "Invalid filename"
    id_slot negative                    400 "Invalid slot ID"    (one past the last wraps round)
    the slot is processing              answered once it is idle (llama-server defers the task)
    a failed write                      500 "Unable to save slot"
    a missing or unreadable file        400 "Unable to restore slot: ..." (and the slot is empty)

Every error is {"error": {"code", "message", "type"}} with the code as the status. Each action
writes one line to the stub's log (`slot-save`, `slot-restore`, `slot-erase`, with the slot id,
the file and the counts or the error), so tests can read what was saved or restored where.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from hal0d_stub.slots import ServerSlots, SlotActionError

STATUS_OF = {"invalid_request_error": 400, "server_error": 500, "not_supported_error": 501,
             "unavailable_error": 503}
NO_SAVE_PATH = "This server does not support slots action. Start it with `--slot-save-path`"
# std::stoi: leading whitespace, a sign, digits; whatever follows them is ignored.
STOI = re.compile(r"[ \t\n\v\f\r]*([+-]?[0-9]+)")
INT_RANGE = range(-(2**31), 2**31)
# fs_validate_filename's characters: Windows' illegal ones and the path separators, plus the
# Unicode look-alikes of '.', '/' and '\', the replacement character and the BOM.
REFUSED_CHARACTERS = frozenset(':*?"<>|/\\\uff0e\u2215\u2216\ufffd\ufeff')
MAX_FILENAME_BYTES = 255
# nlohmann::json's names for the JSON types, as its exceptions spell them.
JSON_TYPE_NAMES = {type(None): "null", dict: "object", list: "array", str: "string",
                   bool: "boolean", int: "number", float: "number"}


def llama_json(answer: Any, status: int = 200) -> web.Response:
    """JSON as llama-server writes it: compact, its keys in their order."""
    return web.json_response(answer, status=status,
                             dumps=lambda value: orjson.dumps(value).decode())


def llama_error(message: str, kind: str = "invalid_request_error") -> web.Response:
    status = STATUS_OF[kind]
    return llama_json({"error": {"code": status, "message": message, "type": kind}}, status)


def stoi(text: str) -> int | None:
    match = STOI.match(text)
    if match is None or int(match.group(1)) not in INT_RANGE:
        return None
    return int(match.group(1))


def valid_filename(name: str) -> bool:
    """llama.cpp's fs_validate_filename (without subdirectories)."""
    if not name or len(name.encode("utf-8", "surrogatepass")) > MAX_FILENAME_BYTES:
        return False
    for character in name:
        code = ord(character)
        if (code <= 0x1F or 0x7F <= code <= 0x9F or 0xD800 <= code <= 0xDFFF
                or character in REFUSED_CHARACTERS):
            return False
    if name[0] == " " or name[-1] in " .":
        return False
    return ".." not in name and name != "."


def filename_of(raw: bytes) -> str:
    """The body's `filename`, refused as llama-server refuses it: what nlohmann::json raises
    is a 500 (the message of a parse error is shortened), a name it will not use a 400."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise SlotActionError("[json.exception.parse_error.101] parse error: syntax error while "
                              "parsing value", "server_error") from None
    if not isinstance(body, dict):
        raise SlotActionError("[json.exception.type_error.304] cannot use at() with "
                              f"{JSON_TYPE_NAMES[type(body)]}", "server_error")
    if "filename" not in body:
        raise SlotActionError("[json.exception.out_of_range.403] key 'filename' not found",
                              "server_error")
    name = body["filename"]
    if not isinstance(name, str):
        raise SlotActionError("[json.exception.type_error.302] type must be string, but is "
                              f"{JSON_TYPE_NAMES[type(name)]}", "server_error")
    if not valid_filename(name):
        raise SlotActionError("Invalid filename")
    return name


class SlotApi:
    """The handlers, over the server's slots and the stub's log."""

    def __init__(self, slots: ServerSlots, log: Callable[[str], None]) -> None:
        self._slots = slots
        self._log = log

    async def list_slots(self, request: web.Request) -> web.Response:
        """GET /slots; with ?fail_on_no_slot, a 503 when no slot is idle."""
        described = self._slots.describe()
        if request.query.get("fail_on_no_slot") and all(s["is_processing"] for s in described):
            return llama_error("no slot available", "unavailable_error")
        return llama_json(described)

    async def act(self, request: web.Request) -> web.Response:
        """POST /slots/{id_slot}?action=save|restore|erase."""
        action = request.query.get("action", "")
        where = f"slot-{action or 'action'} id_slot={request.match_info['id_slot']}"
        try:
            answer = await self._run(request, action)
        except SlotActionError as refused:
            named = f" filename={await self._named_file(request)}" if action != "erase" else ""
            self._log(f"{where}{named} status={STATUS_OF[refused.kind]} "
                      f"error={refused.message!r}")
            return llama_error(refused.message, refused.kind)
        except asyncio.CancelledError:
            self._log(f"{where} cancelled (client went away)")
            raise
        counts = (" ".join(f"{key}={value}" for key, value in answer.items()
                           if key not in ("id_slot", "timings"))
                  if isinstance(answer, dict) else f"odd answer={answer!r}")
        self._log(f"{where} {counts} status=200")
        return llama_json(answer)

    async def _named_file(self, request: web.Request) -> str:
        """The filename a refused request named, for its log line ("-" when none)."""
        try:
            name = orjson.loads(await request.read()).get("filename")
        except (orjson.JSONDecodeError, AttributeError):
            return "-"
        return name if isinstance(name, str) else "-"

    async def _run(self, request: web.Request, action: str) -> Any:
        if self._slots.options.save_path is None:
            raise SlotActionError(NO_SAVE_PATH, "not_supported_error")
        id_slot = stoi(request.match_info["id_slot"])
        if id_slot is None:
            raise SlotActionError("Invalid slot ID")
        if action == "erase":
            return await self._slots.erase(id_slot)
        file_actions: dict[str, Callable[[int, str], Awaitable[Any]]] = {
            "save": self._slots.save, "restore": self._slots.restore}
        if action not in file_actions:
            raise SlotActionError("Invalid action")
        return await file_actions[action](id_slot, filename_of(await request.read()))
