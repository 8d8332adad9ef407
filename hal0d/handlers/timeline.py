"""GET /api/timeline: the last hour per minute and per slot, as the status page's charts draw it
and a Grafana panel (the JSON API or Infinity data source) can read it: the requests' per-minute
figures from the history, the loads, unloads and errors from the lifecycle's log, each group's
memory."""

from __future__ import annotations

import time
from typing import Any, Final

from aiohttp import web

from hal0d.appkeys import RECORDER, RUNTIME, SLOTS, TIMELINE
from hal0d.handlers.admin import json, unix_time
from hal0d.lifecycle.slots import SlotState
from hal0d.lifecycle.vocabulary import LOADED

BUCKET_S: Final = 60
WINDOW_S: Final = 3600.0
# How far back `since` may reach: the minutes come from the history, which keeps more than a
# day, but one answer stays a bounded size (a day is 1440 minutes per slot).
MAX_WINDOW_S: Final = 86400.0


def since_of(request: web.Request, now: float) -> float:
    since = unix_time(request, "since")
    if since is None:
        return now - WINDOW_S
    return min(max(since, now - MAX_WINDOW_S), now)


async def timeline(request: web.Request) -> web.Response:
    now = time.time()
    since = since_of(request, now)
    history = request.app[RECORDER].history
    await history.flush()  # the rows of requests that already ended, still queued
    minutes = await history.minutes(since, BUCKET_S)
    log = request.app[TIMELINE].log
    table = request.app[SLOTS]
    config = request.app[RUNTIME].current.config
    configs = {slot.name: slot for slot in config.slots}
    now_as = {slot.name: "error" if slot.state is SlotState.ERROR
              else "loaded" if slot.state in LOADED else None for slot in table}
    slots = [{"name": slot.name, "state": str(slot.state),
              "group": configs[slot.name].group if slot.name in configs else None,
              "memory_mib": configs[slot.name].memory_mib if slot.name in configs else None}
             for slot in table]
    return json({
        "now": now,
        "since": since,
        "bucket_s": BUCKET_S,
        "kept_since": max(since, log.horizon(now)),
        "slots": slots,
        "minutes": minutes,
        "spans": [{"slot": span.slot, "state": span.state, "from": span.start, "to": span.end,
                   "outcome": span.outcome} for span in log.spans(since, now_as)],
        "events": log.events(since),
        "groups": await groups(request, slots),
    })


async def groups(request: web.Request, slots: list[dict[str, Any]]) -> list[dict[str, Any]]:
    config = request.app[RUNTIME].current.config
    free_memory = request.app[TIMELINE].free_memory
    out = []
    for name, group in config.groups.items():
        loaded = [{"slot": slot["name"], "memory_mib": slot["memory_mib"]} for slot in slots
                  if slot["group"] == name and slot["state"] in {str(s) for s in LOADED}]
        free, free_at = await free_memory.read(group)
        out.append({
            "name": name, "memory_mib": group.memory_mib, "max_loaded": group.max_loaded,
            "members": [slot["name"] for slot in slots if slot["group"] == name],
            "loaded": loaded, "used_mib": sum(item["memory_mib"] or 0 for item in loaded),
            "free_mib": free, "free_at": free_at,
        })
    return out
