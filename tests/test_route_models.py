"""A [[routes]] model as the clients list it, over real sockets: /v1/models in its best slot's
state (a route whose first box is down, or whose first slot must load while its second is warm,
is ready by the second), Ollama's /api/tags and /api/show naming the route and its slots, and
/api/ps listing it while any of its slots has it loaded, for a key whose only model it is.

The Home Assistant setup of issue 38: a route `assist` over a dead box and a working one."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp.test_utils import TestServer
from ollama import AsyncClient

from hal0d.config import Config, parse
from tests.harness.client import views
from tests.harness.daemons import OllamaFactory, ServerFactory
from tests.harness.poll import eventually
from tests.harness.ports import free_port
from tests.harness.stubs import Stub, stub_command

ADMIN, HA = "sk-admin-route-models", "sk-ha-route-models"


def assist_config(stub: Stub, tmp_path: Path, extra: str = "") -> Config:
    """`deadbox` (nothing listens there: in error once probed) first, `smol-a` (the stub)
    second; an admin key, and Home Assistant's key that may use `assist` alone."""
    return parse(tomllib.loads(f"""
[[slots]]
name = "deadbox"
upstream = "http://127.0.0.1:{free_port()}"
models = ["deadbox-own"]

[[slots]]
name = "smol-a"
upstream = "{stub.url}"
models = ["chat"]

[[routes]]
model = "assist"
slots = ["deadbox", "smol-a"]
served = {{ deadbox = "chat", smol-a = "chat" }}

[[keys]]
name = "admin"
key = "{ADMIN}"
scopes = ["inference", "read", "admin"]

[[keys]]
name = "ha"
key = "{HA}"
scopes = ["inference"]
models = ["assist"]
{extra}
[metrics]
database = "{tmp_path / 'history.sqlite3'}"
"""), base_dir=tmp_path)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def listed(http: aiohttp.ClientSession, hal0d: TestServer, key: str
                 ) -> dict[str, dict[str, Any]]:
    async with http.get(hal0d.make_url("/v1/models"), headers=bearer(key)) as resp:
        assert resp.status == 200, await resp.text()
        return {model["id"]: model for model in (await resp.json())["data"]}


async def deadbox_in_error(http: aiohttp.ClientSession, hal0d: TestServer) -> None:
    async def probed() -> bool:
        async with http.get(hal0d.make_url("/api/slots"), headers=bearer(ADMIN)) as resp:
            states = {view["name"]: view["state"] for view in (await resp.json())["slots"]}
        return states == {"deadbox": "error", "smol-a": "ready"}

    await eventually(probed, 10, "deadbox probed into error, smol-a ready")


async def test_a_route_whose_first_box_is_down_is_listed_ready_by_the_slot_that_answers(
    start_ollama: OllamaFactory, stub: Stub, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    hal0d, base = await start_ollama("http://unused", config=assist_config(stub, tmp_path))
    await deadbox_in_error(http, hal0d)
    assert (await listed(http, hal0d, HA)) == {"assist": {
        "id": "assist", "object": "model", "created": 0, "owned_by": "smol-a",
        "state": "ready", "slots": ["deadbox", "smol-a"]}}
    # /api/slots (the status page's) shows the route the same way, each slot in its own state.
    async with http.get(hal0d.make_url("/api/slots"), headers=bearer(ADMIN)) as resp:
        [route] = (await resp.json())["routes"]
    assert (route["model"], route["state"], route["slot"]) == ("assist", "ready", "smol-a")
    assert route["slots"] == [{"name": "deadbox", "served": "chat", "state": "error"},
                              {"name": "smol-a", "served": "chat", "state": "ready"}]

    ha = AsyncClient(host=base, headers=bearer(HA))
    shown = await ha.show("assist")
    assert shown.modelinfo is not None
    assert (shown.modelinfo.get("hal0d.route"), shown.modelinfo.get("hal0d.slots")) == (
        "assist", ["deadbox", "smol-a"])
    assert "hal0d.slot" not in shown.modelinfo  # not its first slot, deadbox
    async with http.post(base + "/api/show", json={"model": "assist"},
                         headers=bearer(HA)) as resp:
        details = (await resp.json())["details"]
    assert (details["route"], details["slots"], details.get("slot")) == (
        "assist", ["deadbox", "smol-a"], None)
    async with http.get(base + "/api/tags", headers=bearer(HA)) as resp:
        [tag] = (await resp.json())["models"]
    assert (tag["name"], tag["details"]["route"], tag["details"].get("slot")) == (
        "assist", "assist", None)

    # The key's only model is the route, which smol-a has loaded: /api/ps lists it, by smol-a,
    # with the route's digest (the one /api/tags gives it).
    running = (await ha.ps()).models
    assert [model.model for model in running] == ["assist"]
    async with http.get(base + "/api/ps", headers=bearer(HA)) as resp:
        [row] = (await resp.json())["models"]
    assert (row["details"]["slot"], row["details"]["slots"], row["digest"]) == (
        "smol-a", ["deadbox", "smol-a"], tag["digest"])
    answer = await ha.chat("assist", [{"role": "user", "content": "hi"}], stream=False)
    assert answer.message.content.startswith("Hello!")


async def test_a_failover_route_whose_first_slot_must_load_is_listed_by_its_warm_second(
    start_hal0d: ServerFactory, stub: Stub, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """The first slot is on demand and at rest, the second up: the route is ready (a slot of it
    answers now), shown by the second; once the first is loaded too, by the first again (ties
    keep the route's order)."""
    port = free_port()
    command = orjson.dumps(list(stub_command(port, tmp_path / "cold.log"))).decode()
    config = parse(tomllib.loads(f"""
[[slots]]
name = "cold"
upstream = "http://127.0.0.1:{port}"
models = ["cold-own"]
command = {command}
start = "on_demand"

[[slots]]
name = "warm"
upstream = "{stub.url}"
models = ["chat"]

[[routes]]
model = "pair"
slots = ["cold", "warm"]
served = {{ cold = "chat", warm = "chat" }}

[metrics]
database = "{tmp_path / 'history.sqlite3'}"
"""), base_dir=tmp_path)
    hal0d = await start_hal0d("http://unused", config=config)

    async def pair() -> dict[str, Any]:
        async with http.get(hal0d.make_url("/v1/models")) as resp:
            return next(m for m in (await resp.json())["data"] if m["id"] == "pair")

    async def warm_ready() -> bool:
        return (await views(http, hal0d))["warm"]["state"] == "ready"

    await eventually(warm_ready, 10, "the warm slot probed ready")
    shown = await pair()
    assert (shown["owned_by"], shown["state"], shown["slots"]) == ("warm", "ready",
                                                                   ["cold", "warm"])
    async with http.post(hal0d.make_url("/api/slots/cold/load")) as resp:
        assert resp.status == 200, await resp.text()
    shown = await pair()
    assert (shown["owned_by"], shown["state"]) == ("cold", "ready")
