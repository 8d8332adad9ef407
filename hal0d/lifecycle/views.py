"""What /api/slots and the event feed show of a slot beyond its admission snapshot: its group's
limits and the swap it may wait for, and for an on-demand slot its load (loaded and idle for how
long, when the idle timer unloads it, its process, how long its loads take); and of each group,
whose turn it is and what its swaps cost.

Read only: each function is handed the parts of the lifecycle manager's state it shows (the
slot's config, its group, its runner), so a view never changes what it looks at.
"""

from __future__ import annotations

import time
from typing import Any

from hal0d.config import SlotConfig
from hal0d.lifecycle import room
from hal0d.lifecycle.groups import Group
from hal0d.lifecycle.room import Member
from hal0d.lifecycle.runner import Runner
from hal0d.lifecycle.slots import Slot, SlotState


def unloads_in(runner: Runner | None, now: float) -> float | None:
    """Seconds until the slot's idle timer unloads it: counted from its last use while it is
    ready, the whole timer while it serves; None when nothing will (a slot hal0d does not
    unload, an idle_unload_s of 0, a negative keep_alive)."""
    idle_s = runner.idle_unload_s() if runner is not None else None
    if runner is None or idle_s is None:
        return None
    if runner.slot.state is SlotState.READY:
        return max(0.0, idle_s - (now - runner.last_used))
    return idle_s


def slot_view(slot: Slot, config: SlotConfig | None, group: Group | None,
              runner: Runner | None, warm: int = 0) -> dict[str, Any]:
    """A slot as /api/slots and the event feed show it; `warm`: how many conversations it
    holds (conversations.Affinity), and its saved prompt caches when it keeps them."""
    now = time.monotonic()
    view = slot.snapshot()
    view["group"] = config.group if config else None
    view["memory_mib"] = config.memory_mib if config else None
    view["group_memory_mib"] = group.config.memory_mib if group else None
    view["group_max_loaded"] = group.config.max_loaded if group else None
    if group is not None:
        pending = group.pending
        view["group_policy"] = group.config.policy
        view["group_max_wait_s"] = group.config.max_wait_s
        view["group_min_turn_loads"] = group.config.min_turn_loads
        # What a request waiting for its model's turn adds to its queue's bound
        # (room.queue_bound_s): the others' turns, their loads as long as load_timeout_s allows.
        view["turn_wait_s"] = slot.turn_wait_s
        # A swap waiting for a batch to end, on the waiting slot's view and the victim's.
        view["pending_swap"] = (pending.view(now) if pending is not None
                                and slot.name in (pending.slot, pending.victim) else None)
    if runner is not None and runner.config.on_demand:
        view.update(_load_view(runner, now))
        if group is None:  # sharing the box where devices are read: its turn there; else 0
            view["turn_wait_s"] = slot.turn_wait_s
    view["conversations_warm"] = warm
    cache = runner.prompt_cache() if runner is not None else None
    view["prompt_cache"] = cache.status.view() if cache is not None else None
    return view


def group_view(group: Group, members: list[Member], now: float) -> dict[str, Any]:
    """A group as /api/slots shows it: what is loaded and when its turn ends, the turn a busy
    model gets now (priced by the measured swaps: room.Pricing) and the longest a request waits
    for its model's turn, the loads waiting for their turn in the order they get it, the swap
    that waits for a busy model, what a swap costs (measured whole: the victim's drain and
    save, the load, the restore, the first answer) and the share of the last hour spent
    swapping, and how long each model's oldest request has waited."""
    limits, clock, pricing = group.config, group.clock, group.pricing()
    loaded = [m for m in members if m.occupies()]
    turn_ends = {m.slot.name: round(max(0.0, ends - now), 1) for m in loaded
                 if m.evictable and (ends := room.turn_ends(pricing, m)) is not None}
    waits = {m.slot.name: round(now - since, 1) for m in members
             if (since := m.slot.oldest_waiting_since()) is not None}
    loads = [m.load_s for m in members if m.evictable and m.load_s is not None]
    return {
        "name": limits.name, "policy": limits.policy, "max_loaded": limits.max_loaded,
        "memory_mib": limits.memory_mib, "max_swap_share": limits.max_swap_share,
        "max_wait_s": limits.max_wait_s, "min_turn_loads": limits.min_turn_loads,
        "loaded": [m.slot.name for m in loaded],
        "turn_s": round(pricing.turn_s(max(loads) if loads else None), 1),
        "turn_ends_in_s": turn_ends,
        "wait_bound_s": room.wait_bound_s(pricing, members),
        "turn_order": [slot.name for slot, _, grant in group.waiting if not grant.done()],
        "pending_swap": group.pending.view(now) if group.pending is not None else None,
        "swaps": clock.count, "swap_cost_s": clock.cost_s(),
        "swap_share": clock.share(now),
        "longest_wait_s": waits,
    }


def _load_view(runner: Runner, now: float) -> dict[str, object]:
    ready = runner.slot.state is SlotState.READY
    idle_unload_in = unloads_in(runner, now) if ready else None
    return {
        "start": runner.config.start,
        "loaded_for_s": round(now - runner.loaded_at, 1) if runner.loaded_at else None,
        "idle_for_s": round(now - runner.last_used, 1) if ready else None,
        "idle_unload_in_s": None if idle_unload_in is None else round(idle_unload_in, 1),
        "keep_alive_s": runner.keep_alive_s,
        "pid": runner.child.pid if runner.child else None,
        "load_s": runner.load_s,
    }
