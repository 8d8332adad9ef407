"""The Ollama listener in a real `hal0d serve`: it listens beside [server] from one application,
drains with it on SIGTERM (an open Ollama stream gets its terminal object), a port it cannot have
stops hal0d before anything starts, and check-config names a bad [ollama] listen."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp
import orjson

from hal0d.config import ConfigError, parse
from tests.harness.config import GRACE_S, config_text
from tests.harness.daemons import EXIT_SLACK_S, Hal0dProcessFactory
from tests.harness.ports import free_port
from tests.harness.stubs import Stub

LONG = {"model": "reasoning", "messages": [{"role": "user", "content": "long"}],
        "options": {"num_predict": 1_000_000}}


def ollama_table(port: int) -> str:
    return f'\n[ollama]\nlisten = "127.0.0.1:{port}"\n'


async def test_sigterm_ends_an_open_ollama_stream_with_its_terminal_object(
        stub: Stub, start_hal0d_process: Hal0dProcessFactory) -> None:
    port = free_port()
    hal0d = await start_hal0d_process(stub.url, extra=ollama_table(port))
    started = hal0d.named("server.started")[0]
    assert started["ollama"] == f"127.0.0.1:{port}"
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{port}/") as resp:
            assert await resp.text() == "Ollama is running"
        async with http.post(f"http://127.0.0.1:{port}/api/chat", json=LONG) as resp:
            assert resp.status == 200
            await resp.content.readline()  # the stream is open
            hal0d.send(signal.SIGTERM)
            rest = await asyncio.wait_for(resp.read(), GRACE_S + EXIT_SLACK_S)
    last = orjson.loads(rest.splitlines()[-1])
    assert last["done"] is True and last["done_reason"] == "length"
    assert last["x_hal0_stall"]["reason"] == "shutdown"
    assert await asyncio.wait_for(hal0d.process.wait(), EXIT_SLACK_S) == 0


def test_a_taken_ollama_port_exits_1_naming_it_before_any_slot_starts(
        tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = tmp_path / "hal0d.toml"
        config.write_text(config_text("http://127.0.0.1:9", free_port(), tmp_path,
                                      extra=ollama_table(port)))
        result = subprocess.run([sys.executable, "-m", "hal0d", "serve", "--config", str(config)],
                                capture_output=True, text=True, timeout=30)
    assert result.returncode == 1
    failed = [orjson.loads(line) for line in result.stdout.splitlines()
              if "server.bind_failed" in line]
    assert failed and failed[0]["listener"] == "ollama" and failed[0]["port"] == port
    assert "[ollama].listen" in failed[0]["hint"]
    assert "server.started" not in result.stdout


def test_check_config_names_a_bad_ollama_listen() -> None:
    for listen, problem in (("11434", "is not host:port"), ("127.0.0.1:8080", "[server].port"),
                            ("::1:11434", "is not host:port")):
        try:
            parse({"ollama": {"listen": listen}})
        except ConfigError as exc:
            assert any(p.startswith("ollama.listen:") and problem in p for p in exc.problems)
        else:
            raise AssertionError(f"{listen!r} was accepted")
    try:
        parse({"ollama": {"port": 1}})
    except ConfigError as exc:
        assert exc.problems == ["ollama.port: unknown key (known: listen, truncate, anonymous)"]
    assert parse({"ollama": {"listen": "[::1]:11434"}}).ollama.address == ("::1", 11434)
