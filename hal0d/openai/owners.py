"""Which model created a Responses API answer, so GET and DELETE /v1/responses/{id} reach the slot
that holds it (pure).

The map is an LRU bounded at MAX_RESPONSE_IDS ids: an answer older than the last few thousand is
forgotten and answers 404 (the slot may still hold it, but hal0d no longer knows which slot), so
a long-running hal0d keeps a fixed few hundred KiB for it however many answers it relays.
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["MAX_RESPONSE_IDS", "ResponseOwners"]

MAX_RESPONSE_IDS = 4096


class ResponseOwners:
    """response id -> the model name the client asked for, the least recently used dropped."""

    __slots__ = ("_ids", "capacity")

    def __init__(self, capacity: int = MAX_RESPONSE_IDS) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[str, str] = OrderedDict()

    def remember(self, response_id: str, model: str) -> None:
        self._ids[response_id] = model
        self._ids.move_to_end(response_id)
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def owner(self, response_id: str) -> str | None:
        model = self._ids.get(response_id)
        if model is not None:
            self._ids.move_to_end(response_id)
        return model

    def forget(self, response_id: str) -> None:
        self._ids.pop(response_id, None)

    def __len__(self) -> int:
        return len(self._ids)
