"""The scoped keys ([[keys]]) the keys tests configure, and asking with one: five keys of every
scope and limit (`KEYS_TOML`), hal0d in process in front of the stub with them (`start_keyed`),
and a request made with a key's bearer header (`call`)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp.test_utils import TestServer

from hal0d.config import parse
from tests.harness.client import chat_body
from tests.harness.daemons import ServerFactory
from tests.harness.ports import free_port
from tests.harness.stubs import Stub, stub_command

INFERENCE_KEY = "hal0-inference-key-Vw3kq"
READ_KEY = "hal0-read-key-Lm8zr"
ADMIN_KEY = "hal0-admin-key-Qp2dx"
ONE_AT_A_TIME_KEY = "hal0-single-key-Hy6tn"
PER_MINUTE_KEY = "hal0-minute-key-Bc4ws"
SECRETS = (INFERENCE_KEY, READ_KEY, ADMIN_KEY, ONE_AT_A_TIME_KEY, PER_MINUTE_KEY)

KEYS_TOML = f"""
[[keys]]
name = "laptop"
key = "{INFERENCE_KEY}"
scopes = ["inference"]
models = ["chat*"]

[[keys]]
name = "dashboard"
key = "{READ_KEY}"
scopes = ["read"]

[[keys]]
name = "operator"
key = "{ADMIN_KEY}"
scopes = ["admin", "read"]

[[keys]]
name = "agent"
key = "{ONE_AT_A_TIME_KEY}"
scopes = ["inference"]
max_concurrent = 1

[[keys]]
name = "script"
key = "{PER_MINUTE_KEY}"
scopes = ["inference"]
requests_per_minute = 2
"""


def keyed_config_text(upstream: str, tmp_path: Path) -> str:
    # The aliases are other names of the stub's own models: a key's globs name the served model
    # an alias resolves to; `ondemand` is a slot hal0d starts and stops itself (what an admin
    # key loads and unloads).
    port = free_port()
    command = orjson.dumps(list(stub_command(port, tmp_path / "ondemand.log"))).decode()
    return f"""
[models]
plain = "chat"
plain-large = "tool"
r1 = "reasoning"

[[slots]]
name = "llm"
upstream = "{upstream}"
models = ["chat", "tool", "reasoning"]

[[slots]]
name = "ondemand"
upstream = "http://127.0.0.1:{port}"
models = ["think-only"]
command = {command}
start = "on_demand"

[metrics]
database = "{tmp_path / 'history.sqlite3'}"
""" + KEYS_TOML


async def start_keyed(start_hal0d: ServerFactory, stub: Stub, tmp_path: Path) -> TestServer:
    config = parse(tomllib.loads(keyed_config_text(stub.url, tmp_path)), base_dir=tmp_path)
    return await start_hal0d(stub.url, config=config)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def call(http: aiohttp.ClientSession, hal0d: TestServer, method: str, path: str,
               key: str, *, body: Any = None) -> tuple[int, Any, Any]:
    data = None if body is None else orjson.dumps(body)
    async with http.request(method, hal0d.make_url(path), data=data,
                            headers=bearer(key)) as resp:
        if resp.content_type == "application/json":
            return resp.status, await resp.json(), resp.headers
        return resp.status, await resp.text(), resp.headers


def chat(model: str) -> dict[str, Any]:
    return chat_body(model, stream=False)
