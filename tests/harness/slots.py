"""A slot outside a daemon, as the slot tests build one: a config of only the keys a Slot reads
(`Cfg`), an observer that keeps each state change (`Seen`), and a slot in a given state with the
changes it told (`make_slot`). `S` and `E` are short for the states and events of its table."""

from __future__ import annotations

from dataclasses import dataclass

from hal0d.lifecycle.machine import Event
from hal0d.lifecycle.slots import Slot, SlotState

S = SlotState
E = Event


@dataclass(frozen=True)
class Cfg:
    name: str = "llm"
    max_concurrent: int = 1
    max_queue: int = 32
    queue_timeout_s: float = 5.0
    load_timeout_s: float = 30.0
    upstream: str = "http://127.0.0.1:8080"
    models: tuple[str, ...] = ("qwen",)


Change = tuple[str, SlotState, SlotState, "str | None"]


class Seen:
    """A slot's observer that keeps each state change; a given `fail` raises on each."""

    def __init__(self, fail: Exception | None = None) -> None:
        self.changes: list[Change] = []
        self.fail = fail

    def state_changed(self, slot: Slot, old: SlotState, new: SlotState,
                      reason: str | None) -> None:
        if self.fail is not None:
            raise self.fail
        self.changes.append((slot.name, old, new, reason))

    def counts_changed(self, slot: Slot) -> None:
        pass


def make_slot(state: SlotState = S.READY, **kw: object) -> tuple[Slot, list[Change]]:
    seen = Seen()
    return Slot(Cfg(**kw), observer=seen, state=state), seen.changes  # type: ignore[arg-type]
