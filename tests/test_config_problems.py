"""How a broken config is told: check-config names the unknown scope among valid ones, a route
or an alias that names a slot with problems of its own adds none (the slot's say what to fix),
and a SIGHUP that reads such a file logs each problem on a line of its own, readable on a
key=value line as on journald's, while hal0d serves on from the running configuration."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import aiohttp
import orjson

from hal0d.config.spec import SLOT_SPEC
from tests.harness.client import chat_body
from tests.harness.daemons import spawn
from tests.harness.poll import eventually
from tests.harness.ports import free_port
from tests.harness.stubs import Stub

ROOT = Path(__file__).resolve().parents[1]
HA_KEY = "hal0-problems-test-ha-Kd9wq"

# Two typos in one slot, with a route and aliases that name it and its model, and a key whose
# scopes hold a typo beside two valid ones: three problems, and only those three.
BROKEN = textwrap.dedent(f"""
    [[keys]]
    name = "ha"
    key = "{HA_KEY}"
    scopes = ["inference", "read", "admim"]

    [[slots]]
    name = "smol-a"
    upstream = "http://127.0.0.1:9"
    models = ["smol"]
    max_concurent = 4
    idle_unload = 300

    [[slots]]
    name = "deadbox"
    upstream = "http://127.0.0.1:10"
    models = ["dead"]

    [[routes]]
    model = "assist"
    slots = ["deadbox", "smol-a"]
    served = {{ smol-a = "smol" }}

    [models]
    "smol:latest" = "smol"
    "helper" = "assist"
""")
SLOT_KEYS = ", ".join(SLOT_SPEC)
EXPECTED = [
    "keys[0].scopes: 'admim' is not a scope (scopes: inference, read, admin) (key \"ha\")",
    f'slots[0].max_concurent: unknown key (known: {SLOT_KEYS}) (slot "smol-a")',
    f'slots[0].idle_unload: unknown key (known: {SLOT_KEYS}) (slot "smol-a")',
]


def check_config(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hal0d", "check-config", "--config", str(path)],
                          capture_output=True, text=True, timeout=30, cwd=ROOT)


def test_check_config_names_the_unknown_scope_and_adds_nothing_for_what_names_a_broken_slot(
        tmp_path: Path) -> None:
    path = tmp_path / "hal0d.toml"
    path.write_text(BROKEN)
    result = check_config(path)
    assert result.returncode == 1
    assert result.stderr.splitlines() == EXPECTED, result.stderr

    # Fixed, the same file loads: the route and the aliases were right all along.
    fixed = BROKEN.replace("max_concurent = 4\n", "").replace("idle_unload = 300\n", "")
    path.write_text(fixed.replace('"admim"', '"admin"'))
    assert check_config(path).returncode == 0, check_config(path).stderr


def logged(text: str, event: str, key: str) -> list[str]:
    """The `key` field of every `event` line of a key=value log."""
    values = []
    for line in text.splitlines():
        if f"] {event} " in line and (found := re.search(rf' {key}=("(?:[^"\\]|\\.)*"|\S+)',
                                                          line)):
            value = found.group(1)
            values.append(orjson.loads(value) if value.startswith('"') else value)
    return values


async def test_a_sighup_with_a_broken_config_logs_each_problem_as_a_readable_line(
        stub: Stub, tmp_path: Path) -> None:
    port = free_port()
    head = f"[server]\nport = {port}\n"
    tail = (f'\n[metrics]\ndatabase = "{tmp_path / "history.sqlite3"}"\n'
            '\n[logging]\nformat = "logfmt"\n')
    good = head + f'[[slots]]\nname = "llm"\nupstream = "{stub.url}"\nmodels = ["chat"]\n' + tail
    path, log = tmp_path / "hal0d.toml", tmp_path / "hal0d.log"
    path.write_text(good)
    hal0d = await spawn(path, port, log)
    try:
        await eventually(lambda: "server.started" in log.read_text(), 10.0, "hal0d started")
        path.write_text(head + BROKEN + tail)
        hal0d.send(signal.SIGHUP)
        await eventually(lambda: "config.reload_failed" in log.read_text(), 5.0, "the refusal")
        text = log.read_text()
        assert logged(text, "config.reload_problem", "problem") == EXPECTED, text
        assert logged(text, "config.reload_failed", "problems") == ["3"], text
        assert "['" not in text and "[\"" not in text  # no Python repr of a list anywhere
        async with aiohttp.ClientSession() as http, http.post(
                f"http://127.0.0.1:{port}/v1/chat/completions",
                json=chat_body("chat", stream=False)) as resp:
            assert resp.status == 200  # on the running configuration
    finally:
        hal0d.send(signal.SIGTERM)
        await asyncio.wait_for(hal0d.process.wait(), 15.0)
