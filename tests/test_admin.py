"""The operator's probes over real sockets: /healthz is liveness (with the version), /readyz is
readiness (200 only when a slot can take a request now), and what /readyz shows under api_keys;
and the User-Agent hal0d sends upstream on proxied requests, probes and tokenizer calls."""

from __future__ import annotations

from pathlib import Path

import aiohttp

import hal0d
from hal0d.config import SlotConfig
from tests.harness.client import chat_body
from tests.harness.config import KEY, WRONG_KEY, keyed_config, make_config
from tests.harness.poll import eventually
from tests.harness.ports import free_port
from tests.harness.stubs import Stub, recording_upstream

USER_AGENT = f"hal0d/{hal0d.__version__}"


async def test_healthz_is_liveness_and_names_the_version_even_with_every_slot_in_error(
    start_hal0d, http: aiohttp.ClientSession, tmp_path: Path
):
    dead = f"http://127.0.0.1:{free_port()}"
    hal0d_server = await start_hal0d(dead)
    async with http.get(hal0d_server.make_url("/healthz")) as resp:
        assert resp.status == 200
        assert await resp.json() == {"status": "ok", "version": hal0d.__version__}
    async with http.get(hal0d_server.make_url("/readyz")) as resp:
        assert resp.status == 503
        body = await resp.json()
    assert body["status"] == "not_ready"
    assert body["slots"] == [
        {"name": "llm", "state": "error", "reason": body["slots"][0]["reason"]}
    ]
    assert body["slots"][0]["reason"].startswith("cannot connect")


async def test_readyz_is_200_when_one_slot_of_two_is_ready_and_lists_both(
    stub: Stub, http: aiohttp.ClientSession, tmp_path: Path, aiohttp_server
):
    from hal0d.app import make_app

    dead = SlotConfig(name="down", upstream=f"http://127.0.0.1:{free_port()}", models=("m",))
    config = make_config(stub.url, tmp_path=tmp_path, extra_slots=(dead,))
    server = await aiohttp_server(make_app(config))
    async with http.get(server.make_url("/readyz")) as resp:
        assert resp.status == 200
        body = await resp.json()
    assert body["status"] == "ready"
    states = {slot["name"]: (slot["state"], slot["reason"]) for slot in body["slots"]}
    assert states["llm"] == ("ready", None)
    assert states["down"][0] == "error" and states["down"][1].startswith("cannot connect")
    # `curl --fail` and a load balancer read only the status.
    async with http.head(server.make_url("/readyz")) as resp:
        assert resp.status == 200


async def test_readyz_needs_no_key_like_healthz_but_shows_reasons_only_to_a_key_holder(
    start_hal0d, http: aiohttp.ClientSession, tmp_path: Path
):
    dead = f"http://127.0.0.1:{free_port()}"
    hal0d_server = await start_hal0d(dead, config=keyed_config(dead, tmp_path))
    for headers in ({}, {"x-api-key": WRONG_KEY}):
        async with http.get(hal0d_server.make_url("/readyz"), headers=headers) as resp:
            assert resp.status == 503  # the answer itself, never a 401
            assert (await resp.json())["slots"] == [{"name": "llm", "state": "error"}]
    async with http.get(hal0d_server.make_url("/readyz"),
                        headers={"Authorization": f"Bearer {KEY}"}) as resp:
        assert resp.status == 503
        assert (await resp.json())["slots"][0]["reason"].startswith("cannot connect")
    async with http.get(hal0d_server.make_url("/api/slots")) as resp:
        assert resp.status == 401  # the detailed view stays behind the key


async def test_user_agent_is_hal0ds_on_probes_tokenizer_calls_and_keyless_clients_requests(
    upstream_app, start_hal0d, tmp_path: Path
):
    seen: list[tuple[str, dict[str, str]]] = []
    url = await upstream_app(recording_upstream(seen))
    hal0d_server = await start_hal0d(url, config=make_config(url, tmp_path=tmp_path))
    anthropic = {"model": "chat", "max_tokens": 8, "stream": True,
                 "messages": [{"role": "user", "content": "hi"}]}
    # A client that sends no User-Agent at all.
    async with aiohttp.ClientSession(skip_auto_headers=["User-Agent"]) as bare:
        async with bare.post(hal0d_server.make_url("/v1/chat/completions"),
                             json=chat_body(stream=False)) as resp:
            assert resp.status == 200
        async with bare.post(hal0d_server.make_url("/v1/messages"), json=anthropic) as resp:
            assert resp.status == 200
            await resp.read()
    kinds = {what for what, _ in seen}
    assert {"GET /v1/models", "POST /v1/chat/completions", "POST /tokenize"} <= kinds, kinds
    for what, headers in seen:
        assert headers.get("User-Agent") == USER_AGENT, (what, headers)


async def test_a_clients_own_user_agent_is_kept_on_the_requests_relayed_for_it(
    upstream_app, start_hal0d, tmp_path: Path
):
    seen: list[tuple[str, dict[str, str]]] = []
    url = await upstream_app(recording_upstream(seen))
    hal0d_server = await start_hal0d(url, config=make_config(url, tmp_path=tmp_path))
    client_agent = "OpenAI/Python 1.99.0"
    async with (
        aiohttp.ClientSession(headers={"User-Agent": client_agent}) as client,
        client.post(hal0d_server.make_url("/v1/chat/completions"), json=chat_body()) as resp,
    ):
        assert resp.status == 200
        await resp.read()
    relayed = [headers for what, headers in seen if what == "POST /v1/chat/completions"]
    assert [headers["User-Agent"] for headers in relayed] == [client_agent]
    probes = [headers for what, headers in seen if what == "GET /v1/models"]
    assert probes and all(headers["User-Agent"] == USER_AGENT for headers in probes)


async def test_readyz_is_503_while_every_slot_is_in_its_failure_backoff_and_200_once_loadable(
    start_hal0d, http: aiohttp.ClientSession, tmp_path: Path
):
    """Stopped after a failed load, an on-demand slot can serve nothing until its backoff has
    passed: /readyz says not_ready with the reason (to a key holder only), then ready again,
    since a request would then load it. An always slot whose process cannot start: not ready."""
    import dataclasses

    from hal0d.config import ServerConfig

    missing = "hal0d-no-such-program-x"
    slot = SlotConfig(name="lazy", upstream=f"http://127.0.0.1:{free_port()}", models=("m",),
                      command=(missing,), start="on_demand")
    config = keyed_config("http://unused", tmp_path)
    config = dataclasses.replace(config, slots=(slot,))
    hal0d_server = await start_hal0d("http://unused", config=config)
    keyed = {"Authorization": f"Bearer {KEY}"}

    async def readyz(headers: dict[str, str]) -> tuple[int, dict]:
        async with http.get(hal0d_server.make_url("/readyz"), headers=headers) as resp:
            return resp.status, await resp.json()

    assert (await readyz({}))[0] == 200  # at rest, a request would load it
    async with http.post(hal0d_server.make_url("/v1/chat/completions"), headers=keyed,
                         json={"model": "m", "messages": [{"role": "user", "content": "x"}]}
                         ) as resp:
        assert resp.status == 503 and (await resp.json())["error"]["code"] == "slot.load_failed"
    status, body = await readyz(keyed)
    assert status == 503 and body["status"] == "not_ready", body
    [view] = body["slots"]
    assert view["state"] == "stopped" and f"cannot start {missing!r}" in view["reason"], view
    status, body = await readyz({})
    assert status == 503 and body["slots"] == [{"name": "lazy", "state": "stopped"}], body
    # The first backoff is 1 s; after it the slot is loadable again.
    async def ready_again() -> bool:
        return (await readyz({}))[0] == 200

    await eventually(ready_again, 10, "readyz 200 once the backoff has passed")

    always = dataclasses.replace(slot, name="pinned", start="always")
    pinned = await start_hal0d("http://unused", config=dataclasses.replace(
        config, slots=(always,), server=ServerConfig(),
        metrics=dataclasses.replace(config.metrics, database=str(tmp_path / "b.sqlite3"))))

    async def pinned_in_error() -> dict:
        async with http.get(pinned.make_url("/readyz")) as resp:
            body = await resp.json()
            assert resp.status == 503 and body["status"] == "not_ready", body
            return body if body["slots"][0]["state"] == "error" else {}

    body = await eventually(pinned_in_error, 10, "the always slot in error, not ready")
    assert f"cannot start {missing!r}" in body["slots"][0]["reason"], body
