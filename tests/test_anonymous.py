"""Requests without a key beside keys: a listener's `anonymous` table, over real sockets.

Home Assistant's Ollama integration sends no key. With `[ollama] anonymous` it gets inference on
the models named, from the networks named, and nothing else: another model is a 403 in the
Ollama envelope, hal0d's load, unload and state need a key (401), a request from outside the
networks is a 401 as without the table, and a request that carries a key is judged by that key
alone. Its requests are recorded under the key name `anonymous`. check-config refuses what
would open more than that.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from ollama import AsyncClient, ResponseError

from hal0d import config as configuration
from hal0d.config import SlotConfig
from tests.harness.client import chat_body, state_is, views
from tests.harness.config import on_demand
from tests.harness.daemons import STARTUP_S, ServerFactory
from tests.harness.poll import eventually
from tests.harness.ports import free_port
from tests.harness.stubs import Stub

ROOT = Path(__file__).resolve().parents[1]
ADMIN_KEY = "hal0-anonymous-test-admin-Zr7qk"
LAPTOP_KEY = "hal0-anonymous-test-laptop-Pw4nd"
HI = [{"role": "user", "content": "hi"}]


def config_text(stub: str, ollama_port: int, tmp_path: Path,
                ollama_networks: str = '["127.0.0.0/8"]') -> str:
    """A homelab's: an operator key, a laptop key for `reasoning` alone, and keyless access to
    `chat` on both listeners ([server]'s from loopback, as it names no networks)."""
    return textwrap.dedent(f"""
        [server]
        host = "127.0.0.1"
        anonymous = {{ scopes = ["inference"], models = ["chat"] }}

        [ollama]
        listen = "127.0.0.1:{ollama_port}"
        anonymous = {{ scopes = ["inference"], models = ["chat"], networks = {ollama_networks} }}

        [[keys]]
        name = "operator"
        key = "{ADMIN_KEY}"
        scopes = ["inference", "read", "admin"]

        [[keys]]
        name = "laptop"
        key = "{LAPTOP_KEY}"
        scopes = ["inference"]
        models = ["reasoning"]

        [[slots]]
        name = "llm"
        upstream = "{stub}"
        models = ["chat", "reasoning"]

        [metrics]
        database = "{tmp_path / 'history.sqlite3'}"
    """)


async def start(start_hal0d: ServerFactory, stub: Stub, tmp_path: Path,
                slot: SlotConfig | None = None, **options: Any) -> tuple[TestServer, str]:
    """hal0d from config_text (`slot`: its one slot instead), with its Ollama listener as
    `hal0d serve` has it (a second site of the one application); the server and the Ollama
    listener's URL."""
    port = free_port()
    config = configuration.parse(tomllib.loads(config_text(stub.url, port, tmp_path, **options)),
                                 base_dir=tmp_path)
    if slot is not None:
        config = dataclasses.replace(config, slots=(slot,))
    server = await start_hal0d(stub.url, config=config)
    assert server.runner is not None
    await web.TCPSite(server.runner, "127.0.0.1", port).start()
    return server, f"http://127.0.0.1:{port}"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_home_assistant_without_a_key_gets_its_models_on_the_ollama_listener_and_no_more(
        start_hal0d: ServerFactory, stub: Stub, tmp_path: Path) -> None:
    hal0d, ollama = await start(start_hal0d, stub, tmp_path)
    client = AsyncClient(host=ollama)  # as Home Assistant's integration: no key

    answer = await client.chat(model="chat", messages=HI)
    assert answer.message.content
    listed = await client.list()
    assert {model.model.partition(":")[0] for model in listed.models} == {"chat"}

    with pytest.raises(ResponseError) as refused:
        await client.chat(model="reasoning", messages=HI)
    assert refused.value.status_code == 403
    assert "without a key" in refused.value.error and "'reasoning'" in refused.value.error

    # A request with a key is judged by it alone: the laptop's key may not use `chat`, which
    # anonymous may; a wrong key is a 401 even from loopback, never the anonymous access.
    with pytest.raises(ResponseError) as judged:
        await AsyncClient(host=ollama, headers=bearer(LAPTOP_KEY)).chat(model="chat", messages=HI)
    assert judged.value.status_code == 403 and "'laptop'" in judged.value.error
    with pytest.raises(ResponseError) as wrong:
        await AsyncClient(host=ollama, headers=bearer("not-a-key-of-hal0d")).chat(
            model="chat", messages=HI)
    assert wrong.value.status_code == 401

    async def recorded() -> list[dict[str, Any]]:
        async with aiohttp.ClientSession(headers=bearer(ADMIN_KEY)) as http, http.get(
                hal0d.make_url("/api/requests?key=anonymous")) as resp:
            rows: list[dict[str, Any]] = (await resp.json())["requests"]
        assert len(rows) == 2, rows  # the answered chat and the refused one
        return rows

    rows = await eventually(recorded, 5.0, "the anonymous requests in the history")
    assert sorted(row["status"] for row in rows) == [200, 403]
    assert {row["key"] for row in rows} == {"anonymous"}


async def test_without_a_key_hal0ds_load_unload_and_state_stay_behind_a_key(
        start_hal0d: ServerFactory, stub: Stub, tmp_path: Path,
        http: aiohttp.ClientSession) -> None:
    hal0d, _ = await start(start_hal0d, stub, tmp_path)
    for method, path in (("POST", "/api/slots/llm/load"), ("POST", "/api/slots/llm/unload"),
                         ("GET", "/api/slots"), ("GET", "/api/requests")):
        async with http.request(method, hal0d.make_url(path)) as resp:
            assert resp.status == 401, (path, await resp.text())
            assert "an API key is required" in (await resp.json())["error"]["message"]
    async with http.get(hal0d.make_url("/api/slots"), headers=bearer(ADMIN_KEY)) as resp:
        assert resp.status == 200

    # [server]'s own anonymous access: `chat` answered, `reasoning` a 403 in OpenAI's envelope.
    async with http.post(hal0d.make_url("/v1/chat/completions"),
                         json=chat_body("chat", stream=False)) as resp:
        assert resp.status == 200, await resp.text()
    async with http.post(hal0d.make_url("/v1/chat/completions"),
                         json=chat_body("reasoning", stream=False)) as resp:
        assert resp.status == 403
        assert (await resp.json())["error"]["type"] == "permission_error"


@pytest.mark.parametrize(("networks", "status"), [('["10.0.0.0/8"]', 401),
                                                  ('["10.0.0.0/8", "127.0.0.0/8"]', 200)])
async def test_only_a_source_address_in_networks_counts_as_anonymous(
        start_hal0d: ServerFactory, stub: Stub, tmp_path: Path, networks: str,
        status: int) -> None:
    _, ollama = await start(start_hal0d, stub, tmp_path, ollama_networks=networks)
    async with aiohttp.ClientSession() as http, http.post(
            f"{ollama}/api/chat", json={"model": "chat", "messages": HI, "stream": False}) as resp:
        assert resp.status == status, await resp.text()
        if status == 401:
            assert "an API key is required" in (await resp.json())["error"]  # Ollama's envelope


def test_check_config_refuses_admin_a_bad_range_and_no_networks_beyond_loopback(
        tmp_path: Path) -> None:
    path = tmp_path / "hal0d.toml"
    path.write_text(textwrap.dedent(f"""
        [server]
        host = "0.0.0.0"
        anonymous = {{ scopes = ["inference", "admin"] }}

        [ollama]
        listen = "127.0.0.1:{free_port()}"
        anonymous = {{ scopes = ["inference"], networks = ["192.168.1.0/33"] }}

        [[keys]]
        name = "operator"
        key = "{ADMIN_KEY}"
        scopes = ["admin"]

        [[slots]]
        name = "llm"
        upstream = "http://127.0.0.1:9"
        models = ["chat"]
    """))
    result = subprocess.run([sys.executable, "-m", "hal0d", "check-config", "--config", str(path)],
                            capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert result.returncode == 1
    problems = result.stderr.splitlines()
    assert problems == [
        "server.anonymous.scopes: 'admin' is never for requests without a key (anyone could "
        "load and unload) (scopes here: inference, read)",
        "server.anonymous.networks: is required on a listener beyond loopback (0.0.0.0): the "
        "source addresses whose requests without a key count, in CIDR form (\"192.168.1.0/24\")",
        "ollama.anonymous.networks: '192.168.1.0/33' is not an address range in CIDR form "
        "(\"192.168.1.0/24\", \"10.0.0.5/32\", \"fd00::/8\")",
    ], result.stderr


async def test_without_a_key_a_model_is_used_but_not_unloaded_through_ollamas_api(
    start_hal0d: ServerFactory, stub: Stub, tmp_path: Path
) -> None:
    """Ollama's own way to unload, keep_alive 0 with no prompt (`ollama stop`), takes a key as
    hal0d's unload does; a keyless chat's keep_alive is left out, the chat answered. The slot
    is the stub on demand, a process hal0d can unload: with a key, the same keep_alive 0 does."""
    hal0d, base = await start(start_hal0d, stub, tmp_path, slot=on_demand("a", tmp_path))
    keyless = AsyncClient(host=base, timeout=STARTUP_S + 10)
    assert (await keyless.chat(model="chat", messages=HI)).message.content  # loads it
    async with aiohttp.ClientSession(headers=bearer(ADMIN_KEY)) as admin:
        loaded = (await views(admin, hal0d))["a"]
        assert loaded["state"] == "ready" and loaded["pid"] is not None, loaded
        with pytest.raises(ResponseError) as refused:
            await keyless.generate(model="chat", keep_alive=0)
        assert refused.value.status_code == 403 and "unload" in str(refused.value.error)
        answer = await keyless.chat(model="chat", messages=HI, keep_alive=0)
        assert answer.message.content

        async def recorded() -> list[dict[str, Any]]:
            async with admin.get(hal0d.make_url("/api/requests?key=anonymous")) as resp:
                rows: list[dict[str, Any]] = (await resp.json())["requests"]
            assert len(rows) == 3, rows  # two chats and the refused unload
            return rows

        # Each recorded once its lease was given back: a keep_alive 0 told under it would
        # have left the slot idle, and unloading, by then.
        await eventually(recorded, 5.0, "the keyless requests in the history")
        after = (await views(admin, hal0d))["a"]
        assert (after["state"], after["pid"]) == ("ready", loaded["pid"]), after  # still loaded
        operator = AsyncClient(host=base, headers=bearer(ADMIN_KEY))
        stopped = await operator.generate(model="chat", keep_alive=0)
        assert stopped.done_reason == "unload"
        await state_is(admin, hal0d, "a", "stopped")  # what keep_alive 0 does with a key
