"""Which model and slot created a Responses API answer, so GET and DELETE /v1/responses/{id} reach
the slot that holds it, also when a route's model is served by several (pure).

The map is an LRU bounded at MAX_RESPONSE_IDS ids: an answer older than the last few thousand is
forgotten and answers 404 (the slot may still hold it, but hal0d no longer knows which slot), so
a long-running hal0d keeps a fixed few hundred KiB for it however many answers it relays.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

__all__ = ["MAX_RESPONSE_IDS", "Owner", "ResponseOwners"]

MAX_RESPONSE_IDS = 4096


class Owner(NamedTuple):
    model: str  # as the client asked for it
    slot: str  # the slot that answered


class ResponseOwners:
    """response id -> its Owner, the least recently used dropped."""

    __slots__ = ("_ids", "capacity")

    def __init__(self, capacity: int = MAX_RESPONSE_IDS) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[str, Owner] = OrderedDict()

    def remember(self, response_id: str, model: str, slot: str) -> None:
        self._ids[response_id] = Owner(model, slot)
        self._ids.move_to_end(response_id)
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def owner(self, response_id: str) -> Owner | None:
        owner = self._ids.get(response_id)
        if owner is not None:
            self._ids.move_to_end(response_id)
        return owner

    def forget(self, response_id: str) -> None:
        self._ids.pop(response_id, None)

    def __len__(self) -> int:
        return len(self._ids)
