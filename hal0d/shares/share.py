"""A request's share of the box: whose account its tokens count against, its class, its weight."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

INTERACTIVE: Final = "interactive"
BATCH: Final = "batch"
SERVICE_CLASSES: Final = (INTERACTIVE, BATCH)


@dataclass(frozen=True, slots=True)
class Share:
    """What a slot's queue knows of a request's key: the account its tokens are counted in
    (the key's name; "" for a request that has none), whether it is batch work, its weight."""

    account: str = ""
    batch: bool = False
    weight: float = 1.0

    @property
    def service_class(self) -> str:
        return BATCH if self.batch else INTERACTIVE


# Every request without a key or with a key that sets nothing: interactive, weight 1.
DEFAULT_SHARE: Final = Share()
