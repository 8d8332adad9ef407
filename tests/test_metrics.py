"""/metrics over real sockets, read by prometheus_client's own parser: the requests by slot, model
and outcome, the slots' states and gauges while a request is held and another queued, the model
lifecycle's counts (loads, failed loads, evictions, idle unloads), and labels that do not grow
with the paths or ids a client makes up. The figures of a stream are tested in
test_metrics_ttft_and_tokens.py, the history rows in test_history_exit_paths.py."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import aiohttp
from aiohttp import hdrs, web
from prometheus_client.samples import Sample

from hal0d.config import GroupConfig, SlotConfig
from tests.harness.client import CHAT, chat_body
from tests.harness.client import chat as lifecycle_chat
from tests.harness.config import build_config, on_demand
from tests.harness.daemons import STARTUP_S
from tests.harness.observe import get_json, scrape, slot_metrics, value
from tests.harness.poll import eventually
from tests.harness.ports import free_port
from tests.harness.stubs import DONE, FINISH_CHUNK, ROLE_CHUNK, content_chunk

# -- /metrics ------------------------------------------------------------------------------------


async def test_metrics_parse_with_prometheus_client_and_cover_requests_slots_and_trips(
    stub, start_hal0d, http
):
    dead = f"http://127.0.0.1:{free_port()}"
    hal0d = await start_hal0d(
        stub.url,
        dispatcher={"stream_idle_timeout_s": 0.3},
        extra_slots=(SlotConfig(name="gone", upstream=dead, models=("ghost",)),),
    )
    for model in ("chat", "stall"):
        async with http.post(hal0d.make_url(CHAT), json=chat_body(model)) as resp:
            await resp.read()
    async with http.post(hal0d.make_url(CHAT), json=chat_body("ghost")) as resp:
        assert resp.status == 502
    await slot_metrics(http, hal0d, requests=2)
    samples = await scrape(http, hal0d)

    requests = {
        (s.labels["slot"], s.labels["model"], s.labels["outcome"]): s.value
        for s in samples["hal0d_requests_total"]
    }
    assert requests == {
        ("llm", "chat", "ok"): 1,
        ("llm", "stall", "stream_stall_idle"): 1,
        ("gone", "ghost", "upstream_unavailable"): 1,
    }
    assert {s.labels["endpoint"] for s in samples["hal0d_requests_total"]} == {CHAT}
    assert value(samples, "hal0d_request_duration_seconds_count", slot="llm") == 2
    assert value(samples, "hal0d_request_duration_seconds_bucket", slot="llm", le="+Inf") == 2
    assert value(samples, "hal0d_ttft_seconds_count", slot="llm") == 2
    assert value(samples, "hal0d_queue_wait_seconds_count", slot="llm") == 2
    assert value(samples, "hal0d_queue_wait_seconds_count", slot="gone") == 1
    assert value(samples, "hal0d_generated_tokens_total", slot="llm", model="chat") > 0
    assert value(samples, "hal0d_stall_guard_trips_total", slot="llm", reason="idle") == 1
    for slot, state in (("llm", "ready"), ("gone", "error")):
        states = {
            s.labels["state"]: s.value
            for s in samples["hal0d_slot_state"]
            if s.labels["slot"] == slot
        }
        assert set(states) == {"offline", "stopped", "starting", "ready", "serving", "error",
                               "stopping"}
        assert [name for name, v in states.items() if v == 1] == [state]
        assert sum(states.values()) == 1
        assert value(samples, "hal0d_slot_in_flight", slot=slot) == 0
        assert value(samples, "hal0d_slot_queued", slot=slot) == 0
        assert value(samples, "hal0d_upstream_process_restarts_total", slot=slot) == 0


async def test_metrics_slot_gauges_show_a_held_request_and_a_queued_one(
    upstream_app, start_hal0d, http
):
    release = asyncio.Event()

    async def held(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={hdrs.CONTENT_TYPE: "text/event-stream"})
        await response.prepare(request)
        await response.write(ROLE_CHUNK + content_chunk("hi"))
        await release.wait()
        await response.write(FINISH_CHUNK + DONE)
        await response.write_eof()
        return response

    url = await upstream_app({"POST /v1/chat/completions": held})
    hal0d = await start_hal0d(url, slot={"max_concurrent": 1})

    async def client() -> bytes:
        async with http.post(hal0d.make_url(CHAT), json=chat_body()) as resp:
            return await resp.read()

    tasks = [asyncio.create_task(client())]
    async def slot_has(key: str) -> bool:
        return bool((await get_json(http, hal0d, "/api/slots"))["slots"][0][key] >= 1)

    await eventually(lambda: slot_has("in_flight"), 1.0, "the first request in flight")
    tasks.append(asyncio.create_task(client()))
    await eventually(lambda: slot_has("queued"), 1.0, "the second request queued")
    samples = await scrape(http, hal0d)
    assert value(samples, "hal0d_slot_in_flight", slot="llm") == 1
    assert value(samples, "hal0d_slot_queued", slot="llm") == 1
    assert value(samples, "hal0d_slot_state", slot="llm", state="serving") == 1
    assert value(samples, "hal0d_slot_state", slot="llm", state="ready") == 0
    release.set()
    assert all(body.endswith(DONE) for body in await asyncio.gather(*tasks))
    samples = await scrape(http, hal0d)
    assert value(samples, "hal0d_slot_in_flight", slot="llm") == 0
    assert value(samples, "hal0d_slot_state", slot="llm", state="ready") == 1


async def test_metrics_endpoint_labels_do_not_grow_with_unknown_paths(stub, start_hal0d, http):
    hal0d = await start_hal0d(stub.url)
    async with http.post(hal0d.make_url(CHAT), json=chat_body(stream=False)) as resp:
        assert resp.status == 200
    for index in range(3):
        async with http.post(hal0d.make_url(f"/v1/no-such-endpoint-{index}"), json={}) as resp:
            assert resp.status == 404
    samples = await scrape(http, hal0d)
    endpoints = {s.labels["endpoint"] for s in samples["hal0d_requests_total"]}
    # A client must not be able to mint a new time series per path it makes up.
    assert not any("no-such-endpoint" in endpoint for endpoint in endpoints), endpoints


# -- the model lifecycle -----------------------------------------------------------------------


async def test_metrics_count_loads_failed_loads_idle_unloads_and_evictions(
    start_hal0d, http, tmp_path
):
    """On-demand slots with the real stub as their command: each load, failed load, eviction and
    idle unload is counted, and the loaded gauge and the group's memory follow the slots."""
    group = {"gpu0": GroupConfig("gpu0", max_loaded=1, memory_mib=8192)}
    config = build_config(
        tmp_path,
        on_demand("a", tmp_path, group="gpu0", memory_mib=4096),
        on_demand("b", tmp_path, group="gpu0", memory_mib=3072),
        on_demand("c", tmp_path, models=("reasoning",), idle_unload_s=0.3),
        dataclasses.replace(on_demand("c", tmp_path, "--fail-start", "error: no such model file",
                                      models=("tool",)), name="f"),
        groups=group,
    )
    hal0d = await start_hal0d("http://unused", config=config)
    samples = await scrape(http, hal0d)
    assert value(samples, "hal0d_slot_loaded", slot="a") == 0
    assert value(samples, "hal0d_group_memory_mib", group="gpu0") == 0

    assert (await lifecycle_chat(http, hal0d, "chat"))[0] == 200
    samples = await scrape(http, hal0d)
    assert value(samples, "hal0d_slot_loads_total", slot="a", outcome="ok") == 1
    assert value(samples, "hal0d_slot_load_seconds_count", slot="a") == 1
    assert 0 < (value(samples, "hal0d_slot_load_seconds_sum", slot="a") or 0) < STARTUP_S
    assert value(samples, "hal0d_slot_loaded", slot="a") == 1
    assert value(samples, "hal0d_group_memory_mib", group="gpu0") == 4096

    assert (await lifecycle_chat(http, hal0d, "think-only"))[0] == 200  # evicts a
    samples = await scrape(http, hal0d)
    assert value(samples, "hal0d_slot_unloads_total", slot="a", reason="evicted") == 1
    assert value(samples, "hal0d_slot_loaded", slot="a") == 0
    assert value(samples, "hal0d_slot_loaded", slot="b") == 1
    assert value(samples, "hal0d_group_memory_mib", group="gpu0") == 3072

    status, answer = await lifecycle_chat(http, hal0d, "tool")
    assert status == 503 and answer["error"]["code"] == "slot.load_failed"
    samples = await scrape(http, hal0d)
    assert value(samples, "hal0d_slot_loads_total", slot="f", outcome="failed") == 1
    assert value(samples, "hal0d_slot_loads_total", slot="f", outcome="ok") is None
    assert value(samples, "hal0d_slot_load_seconds_count", slot="f") == 1
    assert value(samples, "hal0d_slot_loaded", slot="f") == 0

    assert (await lifecycle_chat(http, hal0d, "reasoning"))[0] == 200

    async def idle_unloaded() -> dict[str, list[Sample]]:
        samples = await scrape(http, hal0d)
        assert value(samples, "hal0d_slot_unloads_total", slot="c", reason="idle") == 1
        return samples

    samples = await eventually(idle_unloaded, 5.0, "c unloaded as idle")
    assert value(samples, "hal0d_slot_loaded", slot="c") == 0
    assert value(samples, "hal0d_slot_loads_total", slot="c", outcome="ok") == 1
    assert value(samples, "hal0d_slot_unloads_total", slot="b", reason="evicted") is None
    assert value(samples, "hal0d_slot_loaded", slot="b") == 1


async def test_made_up_response_ids_add_no_metrics_lines(
    stub: Any, start_hal0d: Any, http: aiohttp.ClientSession
) -> None:
    """Endpoint labels are route templates: 200 requests for made-up /v1/responses ids leave
    /metrics as long as it was after the first few."""
    hal0d = await start_hal0d(stub.url)

    async def ask_made_up(count: int, start: int) -> None:
        for n in range(start, start + count):
            async with http.get(hal0d.make_url(f"/v1/responses/resp_made_up_{n}")) as resp:
                assert resp.status == 404

    async def metrics_lines() -> list[str]:
        async with http.get(hal0d.make_url("/metrics")) as resp:
            return [line for line in (await resp.text()).splitlines()
                    if not line.startswith("#")]

    await ask_made_up(3, 0)
    before = await metrics_lines()
    await ask_made_up(200, 3)
    after = await metrics_lines()
    assert len(after) == len(before)
    assert any('endpoint="/v1/responses/{id}"' in line for line in after)
    assert not any("resp_made_up" in line for line in after)
