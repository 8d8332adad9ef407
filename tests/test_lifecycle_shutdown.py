"""Shutdown is the lifecycle's last word: once hal0d shuts down (LifecycleManager.shut), every
slot is offline and stays so. The probe tells its answer to the manager like every other task,
and the manager's teller refuses what is told after the shutdown, so a probe that asks then, or
whose answer arrives then, brings no slot back. Over real sockets: hal0d in front of an
upstream without a command, which answers GET /v1/models."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer
from structlog.testing import capture_logs

from hal0d.appkeys import LIFECYCLE


async def slot_state(http: aiohttp.ClientSession, hal0d: TestServer) -> str:
    async with http.get(hal0d.make_url("/api/slots")) as resp:
        assert resp.status == 200
        (slot,) = (await resp.json())["slots"]
    return str(slot["state"])


def transitions(logs: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [entry for entry in logs if entry["event"] == "slot.state_changed"]


async def test_a_probe_after_shutdown_leaves_a_slot_without_command_offline(
    upstream_app, start_hal0d, http
):
    hal0d = await start_hal0d(await upstream_app({}))
    lifecycle = hal0d.app[LIFECYCLE]
    assert await slot_state(http, hal0d) == "ready"  # its upstream answers the probe
    lifecycle.shut()
    assert await slot_state(http, hal0d) == "offline"

    with capture_logs() as logs:
        await lifecycle.probe_once("llm")  # the upstream still answers
    assert await slot_state(http, hal0d) == "offline"
    assert transitions(logs) == []


async def test_a_probe_answered_after_shutdown_leaves_the_slot_offline(
    upstream_app, start_hal0d, http
):
    asked, answer = asyncio.Event(), asyncio.Event()
    probes = 0

    async def models(_: web.Request) -> web.Response:
        nonlocal probes
        probes += 1
        if probes > 1:  # hal0d's first probe at its start answers at once; the next one waits
            asked.set()
            await answer.wait()
        return web.json_response({"object": "list", "data": []})

    hal0d = await start_hal0d(await upstream_app({"GET /v1/models": models}))
    lifecycle = hal0d.app[LIFECYCLE]
    assert await slot_state(http, hal0d) == "ready"
    probing = asyncio.create_task(lifecycle.probe_once("llm"))
    await asyncio.wait_for(asked.wait(), 5)

    with capture_logs() as logs:
        lifecycle.shut()
        answer.set()
        await asyncio.wait_for(probing, 5)
    assert await slot_state(http, hal0d) == "offline"
    assert [(entry["old"], entry["new"]) for entry in transitions(logs)] == [("ready", "offline")]
