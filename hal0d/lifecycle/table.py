"""The slot table: every configured slot by name, in config order; a reload adds and removes
slots here (lifecycle/reload.py), and a request's lease is taken through it by name."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from hal0d.errors import SlotLoading
from hal0d.lifecycle.slots import LeaseContext, Slot, SlotLimits
from hal0d.lifecycle.turns import ANONYMOUS
from hal0d.shares import DEFAULT_SHARE, Share
from hal0d.shares.book import ShareBook


class SlotTable:
    """Every configured slot by name, in config order."""

    def __init__(self, configs: Iterable[SlotLimits], book: ShareBook | None = None) -> None:
        # The keys' use lately, which every slot's queue weighs its waiters by (turns.py).
        self.book = book if book is not None else ShareBook()
        self._slots: dict[str, Slot] = {}
        for config in configs:
            if config.name in self._slots:
                raise ValueError(f"duplicate slot name {config.name!r}")
            self._slots[config.name] = Slot(config, book=self.book)

    def get(self, name: str) -> Slot | None:
        return self._slots.get(name)

    def add(self, slot: Slot) -> None:
        """A slot a reload added."""
        if slot.name in self._slots:
            raise ValueError(f"duplicate slot name {slot.name!r}")
        self._slots[slot.name] = slot

    def remove(self, name: str) -> Slot:
        """A slot a reload removed; the caller takes it offline."""
        return self._slots.pop(name)

    def lease(self, name: str, client: str = ANONYMOUS, share: Share = DEFAULT_SHARE
              ) -> LeaseContext:
        """A lease on the named slot; SlotLoading (503) when a reload has just removed it."""
        slot = self._slots.get(name)
        if slot is None:
            raise SlotLoading(
                f"slot {name!r} was removed by a configuration reload", retry_after=1.0
            )
        return slot.lease(client, share)

    def __getitem__(self, name: str) -> Slot:
        return self._slots[name]

    def __contains__(self, name: object) -> bool:
        return name in self._slots

    def __iter__(self) -> Iterator[Slot]:
        return iter(self._slots.values())

    def __len__(self) -> int:
        return len(self._slots)

    def names(self) -> list[str]:
        return list(self._slots)

    def snapshot(self) -> list[dict[str, Any]]:
        return [slot.snapshot() for slot in self._slots.values()]
