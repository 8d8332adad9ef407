"""llama-server's server slots and their prompt cache, as the stub models them.

These are the slots of one model server (`--parallel N`), not hal0d's slots (which are whole
upstreams). Each server slot keeps the tokens of its last prompt (and of what it generated after
it) the way llama-server keeps them in its KV cache, so that a next turn of the same conversation
reads only the tokens it adds:

    request --choose--> a server slot (processing) --prefill prompt_n tokens--> generate
                        cache_n = the prompt's common prefix      |
                        with the slot's tokens                    v
                                                release: the slot holds the prompt and all
                                                but the last generated token (that one was
                                                sampled, never decoded into the cache)

Choosing follows llama-server's own rule (get_available_slot in its server-context.cpp): the slot
`id_slot` names when the request names one (an id past the last slot wraps around, as there);
else, among idle slots that hold tokens, the one whose longest common prefix with the new prompt
is the largest share of the prompt, if that share is over --slot-prompt-similarity (0.10 in the
llama.cpp this stub follows); else the least recently used idle slot (a slot never used counts
as older than any, and among equals the last one wins, so a fresh server's first request lands
in its highest slot, as the captures show). A slot `id_slot` names is waited for while it is
busy, as llama-server defers such a task. What the stub does not model: llama-server's
host-memory prompt cache (--cache-ram), which can bring an evicted prompt back into a slot; and
the queue: a request that names no slot and finds every slot busy is served at once on no slot
(read cold, remembered nowhere), where llama-server would make it wait, because the stub serves
any number of requests at once and the tests rely on that.

A slot's tokens can be saved to a file under --slot-save-path and restored, into any slot of this
or a later process (POST /slots/{id}?action=save|restore|erase; the HTTP side is slot_api.py).
Tokens are the stub's words (a token per whitespace-separated word, as its usage counts them),
each as its CRC-32, so the same text is the same tokens in every process.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import struct
import sys
import time
import zlib
from array import array
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TOKEN_TYPECODE = "I"  # unsigned, 4 bytes wherever Python runs today: a CRC-32 fits
BOS = 1
# How far the common prefix of two token lists is compared at once (in C) before it is looked
# for token by token.
PREFIX_BLOCK = 4096
# The stub's slot file: magic, format version, token count, then the tokens (little-endian).
FILE_MAGIC = b"HSLT"
FILE_VERSION = 1
FILE_HEADER = struct.Struct("<4sII")
# llama-server's words when a slot file cannot be read back (any unreadable or foreign file).
INVALID_FILE = "No available space in KV cache or invalid slot save file"
TOO_LONG = "Restored prompt does not fit in the slot context"


@dataclass(frozen=True)
class SlotOptions:
    """The llama-server options the stub's server slots follow, and its faults on demand."""

    parallel: int = 1  # -np: how many server slots
    ctx_size: int = 4096  # -c: the context of all slots together; each has ctx_size // parallel
    save_path: Path | None = None  # --slot-save-path: without it, /slots actions are refused
    similarity: float = 0.1  # --slot-prompt-similarity; 0 chooses by id_slot and LRU only
    prefill_ms_per_token: float = 0.0  # how long reading each uncached prompt token takes
    save_fail: bool = False  # every save fails as a failed write does (500)
    save_delay: float = 0.0  # every save hangs this long before it is done
    restore_fail: bool = False  # every restore fails as an unreadable file does (400)
    restore_delay: float = 0.0  # every restore hangs this long before it is done
    # Every save (restore) answers 200 with this in place of its object (ODD_ANSWERS): what a
    # server that says something else about itself answers.
    odd_save: str | None = None
    odd_restore: str | None = None


# The odd answers a save or restore can be taught (--slot-odd-answer): valid JSON, not the object
# llama-server answers.
ODD_ANSWERS = ("list", "string", "non_numeric")


def odd_answer(kind: str, count: str) -> Any:
    """What a save or restore answers in place of its object when taught `kind`."""
    if kind == "list":
        return []
    if kind == "string":
        return "saved"
    return {count: "n/a", "n_written": "n/a", "n_read": None}


class SlotActionError(Exception):
    """A save, restore or erase refused, with llama-server's message and error type."""

    def __init__(self, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message = message
        self.kind = kind


def token_ids(text: str, *, add_special: bool = True) -> array[int]:
    """The stub's tokenizer as ids: as many tokens as its count_tokens counts."""
    ids = array(TOKEN_TYPECODE, [BOS] if add_special else [])
    ids.extend(map(zlib.crc32, map(str.encode, text.split())))
    return ids


def piece_id(piece: str) -> int:
    """A generated piece (a word with its leading space) as the token the next prompt's echo of
    it tokenizes to."""
    return zlib.crc32(piece.strip().encode())


def common_prefix(held: array[int], prompt: array[int]) -> int:
    """How many tokens, from the first, the two lists share."""
    length = min(len(held), len(prompt))
    with memoryview(held) as left, memoryview(prompt) as right:
        if left[:length] == right[:length]:
            return length
        start = 0
        while left[start:start + PREFIX_BLOCK] == right[start:start + PREFIX_BLOCK]:
            start += PREFIX_BLOCK
        return start + next(i for i in itertools.count() if left[start + i] != right[start + i])


def c_remainder(number: int, divisor: int) -> int:
    """`number % divisor` as C++ computes it (the sign of the number): llama-server wraps a slot
    id with it, so -2 on two slots is slot 0 and -1 is no slot."""
    remainder = abs(number) % divisor
    return remainder if number >= 0 else -remainder


def requested_slot(body: dict[str, Any]) -> int:
    """The body's `id_slot` as llama-server reads it: a number, else -1 (any slot)."""
    value = body.get("id_slot", -1)
    if isinstance(value, bool | int):
        return int(value)
    if isinstance(value, float) and abs(value) < 2**31:  # NaN is not below anything
        return int(value)
    return -1


def task_params(body: dict[str, Any]) -> dict[str, Any]:
    """A few of the sampling params GET /slots shows of a slot's last task (llama-server shows
    some forty), with llama-server's defaults."""
    limit = body.get("max_tokens", body.get("max_completion_tokens", body.get("n_predict", -1)))
    return {"seed": body.get("seed", 4294967295), "temperature": body.get("temperature", 0.8),
            "top_k": body.get("top_k", 40), "top_p": body.get("top_p", 0.95),
            "min_p": body.get("min_p", 0.05), "max_tokens": limit, "n_predict": limit,
            "n_keep": body.get("n_keep", 0), "stream": body.get("stream") is True}


def llama_timings(cache_n: int, prompt_n: int, prompt_ms: float, predicted_n: int,
                  predicted_ms: float) -> dict[str, int | float]:
    """llama-server's `timings` (server_slot_stats::to_json). Its per-token generation figures
    count decode steps, one fewer than the tokens: the first comes free with the prompt's last
    batch."""
    steps = max(predicted_n - 1, 0)
    return {
        "cache_n": cache_n,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": 1e3 / prompt_ms * prompt_n if prompt_ms > 0 else 0.0,
        "predicted_n": predicted_n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / steps if steps else 0.0,
        "predicted_per_second": 1e3 / predicted_ms * steps if predicted_ms > 0 else 0.0,
    }


def elapsed_ms(since: float, until: float | None = None) -> float:
    """Milliseconds between two monotonic instants, to the microsecond as llama-server has it."""
    return round(((time.monotonic() if until is None else until) - since) * 1000, 3)


def write_slot_file(path: Path, tokens: array[int]) -> int:
    """Write the stub's slot file; returns its size in bytes."""
    body = array(TOKEN_TYPECODE, tokens)
    if sys.byteorder == "big":
        body.byteswap()
    data = FILE_HEADER.pack(FILE_MAGIC, FILE_VERSION, len(body)) + body.tobytes()
    path.write_bytes(data)
    return len(data)


def read_slot_file(path: Path) -> tuple[array[int], int]:
    """The tokens of a slot file and its size; ValueError (llama-server's reason) for a file
    that is missing, unreadable or not the stub's."""
    try:
        data = path.read_bytes()
    except OSError:
        raise ValueError(INVALID_FILE) from None
    tokens = array(TOKEN_TYPECODE)
    payload = data[FILE_HEADER.size:]
    if len(data) < FILE_HEADER.size:
        raise ValueError(INVALID_FILE)
    magic, version, count = FILE_HEADER.unpack_from(data)
    if (magic, version) != (FILE_MAGIC, FILE_VERSION) or count * tokens.itemsize != len(payload):
        raise ValueError(INVALID_FILE)
    tokens.frombytes(payload)
    if sys.byteorder == "big":
        tokens.byteswap()
    return tokens, len(data)


class Turn:
    """One completion's use of a server slot (or of none, every slot being busy): how much of
    its prompt the slot had cached, the prefill, the pieces it generates, its timings."""

    def __init__(self, slot: ServerSlot | None, prompt: array[int], cache_n: int,
                 seconds_per_token: float) -> None:
        self.slot = slot
        self.prompt = prompt
        self.cache_n = cache_n
        self.pieces: list[str] = []
        self._seconds_per_token = seconds_per_token
        self._start = time.monotonic()
        self._prompt_done: float | None = None

    @property
    def prompt_n(self) -> int:
        return len(self.prompt) - self.cache_n

    async def prefill(self) -> None:
        """Read the uncached part of the prompt: prompt_n tokens at the configured pace."""
        if self.prompt_n * self._seconds_per_token > 0:
            await asyncio.sleep(self.prompt_n * self._seconds_per_token)
        self._prompt_done = time.monotonic()
        if self.slot is not None:
            self.slot.tokens = self.prompt

    def generated(self, piece: str) -> None:
        self.pieces.append(piece)

    def held(self) -> array[int]:
        """What the slot's cache holds once the turn ends (or is cut short)."""
        if self._prompt_done is None:
            return self.prompt[:self.cache_n]
        decoded = array(TOKEN_TYPECODE, map(piece_id, self.pieces[:-1]))
        return self.prompt + decoded

    def timings(self, predicted_n: int) -> dict[str, int | float]:
        now = time.monotonic()
        done = now if self._prompt_done is None else self._prompt_done
        predicted_ms = elapsed_ms(done, now) if predicted_n else 0.0
        return llama_timings(self.cache_n, self.prompt_n, elapsed_ms(self._start, done),
                             predicted_n, predicted_ms)


@dataclass
class ServerSlot:
    id: int
    n_ctx: int
    tokens: array[int]
    turn: Turn | None = None  # the completion it is processing
    last_used: int = -1  # when its last completion ended (a sequence number); -1: never
    task_id: int | None = None  # its last completion's: GET /slots shows its task only then
    task_params: dict[str, Any] | None = None

    @property
    def processing(self) -> bool:
        return self.turn is not None

    def describe(self) -> dict[str, Any]:
        """The slot as llama-server's GET /slots shows it (without --slots-debug)."""
        entry: dict[str, Any] = {"id": self.id, "n_ctx": self.n_ctx, "speculative": False,
                                 "is_processing": self.processing}
        if self.task_id is None:
            return entry
        turn = self.turn
        return entry | {
            "id_task": self.task_id,
            "n_prompt_tokens": len(self.tokens),
            # llama-server resets a slot's counters once its task is done.
            "n_prompt_tokens_processed": turn.prompt_n if turn else 0,
            "n_prompt_tokens_cache": turn.cache_n if turn else 0,
            "params": self.task_params,
            "next_token": [{"has_next_token": turn is not None, "has_new_line": False,
                            "n_remain": -1, "n_decoded": len(turn.pieces) if turn else 0}],
        }


class ServerSlots:
    """The server's slots: which one a completion gets, and their save, restore and erase."""

    def __init__(self, options: SlotOptions, log: Callable[[str], None]) -> None:
        self.options = options
        self._log = log
        n_ctx = options.ctx_size // options.parallel
        self.slots = [ServerSlot(i, n_ctx, array(TOKEN_TYPECODE))
                      for i in range(options.parallel)]
        self._uses = itertools.count()
        self._task_ids = itertools.count()
        # Set (then replaced) each time a slot becomes idle: what a waiter for a slot awaits.
        self._released = asyncio.Event()

    def by_id(self, id_slot: int) -> ServerSlot | None:
        index = c_remainder(id_slot, len(self.slots))
        return self.slots[index] if index >= 0 else None

    def choose(self, prompt: array[int], id_slot: int) -> tuple[ServerSlot | None, str]:
        """The slot llama-server would give this prompt, and by which rule; a busy slot only
        when the request names it; None when it names none and every slot is busy."""
        chosen = self.by_id(id_slot) if id_slot != -1 else None
        how = "id_slot"
        if self.options.similarity > 0:
            best = 0.0
            for slot in self.slots:
                if id_slot not in (-1, slot.id) or slot.processing or not slot.tokens:
                    continue
                similarity = common_prefix(slot.tokens, prompt) / len(prompt)
                if similarity > best and similarity > self.options.similarity:
                    best, chosen = similarity, slot
                    how = how if id_slot != -1 else "similarity"
        if chosen is None:
            how = "lru"
            for slot in self.slots:
                if not slot.processing and (chosen is None or slot.last_used <= chosen.last_used):
                    chosen = slot
        return chosen, how if chosen is not None else "busy"

    @contextlib.asynccontextmanager
    async def turn(self, prompt: array[int], body: dict[str, Any]) -> AsyncIterator[Turn]:
        """A completion's hold on its slot, from the choice to the release (the client gone
        included): on release the slot keeps what the turn decoded."""
        slot, how = await self._claim(prompt, requested_slot(body))
        cache_n = 0
        if slot is not None and body.get("cache_prompt", True) is not False:
            cache_n = common_prefix(slot.tokens, prompt)
            if cache_n == len(prompt):
                cache_n -= 1  # llama-server evaluates at least one token of every prompt
        turn = Turn(slot, prompt, cache_n, self.options.prefill_ms_per_token / 1000)
        self._log(f"slot-select id_slot={slot.id if slot else 'none'} by={how} "
                  f"cache_n={cache_n} prompt_n={turn.prompt_n}")
        if slot is None:
            yield turn
            return
        slot.turn, slot.tokens = turn, prompt[:cache_n]
        slot.task_id, slot.task_params = next(self._task_ids), task_params(body)
        try:
            yield turn
        finally:
            slot.tokens, slot.turn, slot.last_used = turn.held(), None, next(self._uses)
            self._released.set()
            self._released = asyncio.Event()

    async def _claim(self, prompt: array[int], id_slot: int) -> tuple[ServerSlot | None, str]:
        while True:
            slot, how = self.choose(prompt, id_slot)
            if slot is None or not slot.processing:
                return slot, how
            await self._released.wait()

    async def _idle(self, id_slot: int) -> ServerSlot:
        """The slot an action names, once it is idle (llama-server defers the action till then)."""
        slot = self.by_id(id_slot)
        if slot is None:
            raise SlotActionError("Invalid slot ID")
        while slot.processing:
            await self._released.wait()
        return slot

    def _file(self, filename: str) -> Path:
        assert self.options.save_path is not None, "slot actions need --slot-save-path"
        return self.options.save_path / filename

    async def save(self, id_slot: int, filename: str) -> Any:
        slot = await self._idle(id_slot)
        started, tokens = time.monotonic(), slot.tokens
        if self.options.save_delay > 0:
            self._log(f"slot-save id_slot={id_slot} filename={filename} "
                      f"hanging {self.options.save_delay:g} s (--slot-save-delay)")
            await asyncio.sleep(self.options.save_delay)
        if self.options.save_fail:
            raise SlotActionError("Unable to save slot", "server_error")
        if self.options.odd_save is not None:
            return odd_answer(self.options.odd_save, "n_saved")
        try:
            written = write_slot_file(self._file(filename), tokens)
        except OSError:
            raise SlotActionError("Unable to save slot", "server_error") from None
        return {"id_slot": id_slot, "filename": filename, "n_saved": len(tokens),
                "n_written": written, "timings": {"save_ms": elapsed_ms(started)}}

    async def restore(self, id_slot: int, filename: str) -> Any:
        slot = await self._idle(id_slot)
        started = time.monotonic()
        if self.options.restore_delay > 0:
            self._log(f"slot-restore id_slot={id_slot} filename={filename} "
                      f"hanging {self.options.restore_delay:g} s (--slot-restore-delay)")
            await asyncio.sleep(self.options.restore_delay)
        if self.options.odd_restore is not None:
            return odd_answer(self.options.odd_restore, "n_restored")
        try:
            if self.options.restore_fail:
                raise ValueError(INVALID_FILE)
            tokens, read = read_slot_file(self._file(filename))
            if len(tokens) > slot.n_ctx:
                raise ValueError(TOO_LONG)
        except ValueError as failure:
            slot.tokens = array(TOKEN_TYPECODE)  # a failed restore leaves the slot empty
            raise SlotActionError(f"Unable to restore slot: {failure}") from None
        slot.tokens = tokens
        return {"id_slot": id_slot, "filename": filename, "n_restored": len(tokens),
                "n_read": read, "timings": {"restore_ms": elapsed_ms(started)}}

    async def erase(self, id_slot: int) -> dict[str, Any]:
        slot = await self._idle(id_slot)
        erased, slot.tokens = len(slot.tokens), array(TOKEN_TYPECODE)
        return {"id_slot": id_slot, "n_erased": erased}

    def describe(self) -> list[dict[str, Any]]:
        return [slot.describe() for slot in self.slots]
