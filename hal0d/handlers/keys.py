"""GET /api/keys (admin scope): each key's share of the box as it stands: its class and weight,
the tokens it used over the share window and against its quotas, its requests queued and in
flight, and its tokens in each minute of the last hour (the page's panel per key)."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from hal0d.appkeys import KEY_LIMITS, RUNTIME, SHARE_BOOK, SLOTS
from hal0d.handlers.admin import json
from hal0d.keys import Key
from hal0d.shares.quotas import TokenCounts, window_of


async def keys(request: web.Request) -> web.Response:
    book, limits = request.app[SHARE_BOOK], request.app[KEY_LIMITS]
    queued: dict[str, int] = {}
    for slot in request.app[SLOTS]:
        for account, count in slot.queued_by_account().items():
            queued[account] = queued.get(account, 0) + count
    now = time.monotonic()
    named = request.app[RUNTIME].current.keys.named()
    used = {key.share.account: book.used(key.share.account, now) for key in named}
    total = sum(used.values())
    lines = []
    for key in named:
        account = key.share.account
        lines.append({
            "name": key.name, "anonymous": key.anonymous,
            "class": key.share.service_class, "weight": key.share.weight,
            "window_tokens": used[account],
            "window_share": round(used[account] / total, 4) if total else 0.0,
            "quotas": quotas_view(key, limits.counts),
            # The key's model calls in hal0d (what max_concurrent counts) less those queued.
            "queued": queued.get(account, 0),
            "in_flight": max(0, limits.in_flight(key.name or "") - queued.get(account, 0)),
            "last_hour_tokens": book.last_hour(account, now),
        })
    return json({"share_window_s": book.window_s, "batch_max_wait_s": book.batch_max_wait_s,
                 "keys": lines})


def quotas_view(key: Key, counts: TokenCounts) -> dict[str, Any]:
    """Each quota of `key`: its limit, what was used in its window, when the window resets
    (unix time)."""
    now = time.time()
    return {quota.per: {"limit": quota.tokens, "used": counts.used(key.name or "", quota.per, now),
                        "resets_at": window_of(quota.per, now)[1]} for quota in key.quotas}
