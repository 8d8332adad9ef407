"""The command line as the operator meets it: `hal0d serve --host/--port`, a port that is taken,
check-config's errors and warnings, print-config's default path, --version. Every test runs the
real `python -m hal0d` process; the served ones talk to it over real sockets."""

from __future__ import annotations

import asyncio
import importlib.metadata
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import orjson
import pytest
from aiohttp import hdrs

import hal0d
from tests.harness.cli import ROOT, env_without, hal0d_cli
from tests.harness.daemons import Hal0dProcess, spawn
from tests.harness.ports import free_port
from tests.harness.stubs import Stub

MISSING_PROGRAM = "llama-serverx-hal0d-test"
UNSET_VARIABLE = "HAL0D_TEST_KEY_THAT_IS_NEVER_SET"
DEADLINE_S = 15.0


def slot_toml(upstream: str, *, command: list[str] | None = None, extra: str = "") -> str:
    lines = [
        "[[slots]]", 'name = "llm"', f'upstream = "{upstream}"', 'models = ["chat"]',
    ]
    if command:
        lines.append(f"command = {orjson.dumps(command).decode()}")
    return "\n".join(lines) + "\n" + extra


def config_toml(tmp_path: Path, port: int, slots: str) -> str:
    return textwrap.dedent(f"""
        [server]
        host = "127.0.0.1"
        port = {port}
        shutdown_grace_s = 1

        [metrics]
        database = "{tmp_path / 'history.sqlite3'}"

        [logging]
        format = "json"
    """) + slots


ServeFactory = Callable[..., Awaitable[Hal0dProcess]]


@pytest.fixture
async def serve(tmp_path: Path) -> AsyncIterator[ServeFactory]:
    started: list[Hal0dProcess] = []

    async def start(config_text: str, *flags: str, port: int, wait: bool = True,
                    env: dict[str, str] | None = None) -> Hal0dProcess:
        config = tmp_path / "hal0d.toml"
        config.write_text(config_text)
        served = await spawn(config, port, tmp_path / f"hal0d-{len(started)}.log", *flags,
                             env=env if env is not None else env_without(UNSET_VARIABLE))
        started.append(served)
        if wait:
            await served.wait_for_event("server.started", DEADLINE_S)
        return served

    yield start
    for served in started:
        if served.process.returncode is None:
            served.process.kill()
            await served.process.wait()


async def refuses_connections(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return True
    writer.close()
    return False


# -- 1. the port

async def test_serve_port_flag_overrides_the_config_and_a_reload_keeps_it_without_a_warning(
    serve, stub: Stub, tmp_path: Path, http: aiohttp.ClientSession
):
    in_file, on_flag = free_port(), free_port()
    served = await serve(config_toml(tmp_path, in_file, slot_toml(stub.url)),
                         "--port", str(on_flag), "--host", "127.0.0.1", port=on_flag)
    started = served.named("server.started")[0]
    assert started["port"] == on_flag
    async with http.get(f"{served.url}/healthz") as resp:
        assert resp.status == 200
    assert await refuses_connections(in_file)

    # The file now names yet another port: the flag still wins, and that is no restart to warn
    # about; the reload's own change (a new alias) is applied.
    served.config.write_text(
        config_toml(tmp_path, free_port(), slot_toml(stub.url)) + '\n[models]\nalias = "chat"\n'
    )
    served.process.send_signal(signal.SIGHUP)
    reloaded = await served.wait_for_event("config.reloaded", DEADLINE_S)
    assert reloaded["aliases"] == 1
    assert served.named("config.restart_needed") == []
    async with http.post(f"{served.url}/v1/chat/completions",
                         json={"model": "alias", "messages": [{"role": "user", "content": "x"}]}
                         ) as resp:
        assert resp.status == 200, await resp.text()


async def test_a_taken_port_exits_1_with_a_hint_naming_the_way_out(serve, stub: Stub,
                                                                    tmp_path: Path):
    """...and before any slot process is started: the port is taken first. A plain `serve`
    is told of --port, one that make runs (`make run`: MAKELEVEL set) of make's PORT=."""
    model_port = free_port()
    command = ["hal0d", "stub", "--port", str(model_port)]
    slots = slot_toml(f"http://127.0.0.1:{model_port}", command=command)
    plain = env_without(UNSET_VARIABLE, "MAKELEVEL", "MAKEFLAGS")
    hints = []
    for env in (plain, {**plain, "MAKELEVEL": "1"}):
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            served = await serve(config_toml(tmp_path, port, slots), port=port, wait=False,
                                 env=env)
            code = await asyncio.wait_for(served.process.wait(), DEADLINE_S)
        assert code == 1
        assert served.named("slot.process_started") == [], served.log.read_text()
        failed = served.named("server.bind_failed")
        assert len(failed) == 1, served.log.read_text()
        assert failed[0]["port"] == port
        assert "address already in use" in failed[0]["error"].lower()
        hints.append(failed[0]["hint"])
    assert hints == [
        "another process listens there; choose another port with --port or [server].port",
        "another process listens there; choose another port with make run PORT=... or "
        "[server].port",
    ]


def test_make_run_passes_port_and_host_only_when_given():
    given = subprocess.run(["make", "-n", "run", "PORT=8123", "HOST=0.0.0.0"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout
    assert "serve --config etc/hal0d.toml --host 0.0.0.0 --port 8123" in " ".join(given.split())
    # tcsh and zsh export HOST as the machine's name: only make's command line counts.
    exported = {**env_without("PORT", "HOST"), "HOST": "somebox", "PORT": "8124"}
    plain = subprocess.run(["make", "-n", "run"], cwd=ROOT, env=exported,
                           capture_output=True, text=True, check=True).stdout
    serve_line = next(line for line in plain.splitlines() if " serve " in line)
    assert "--port" not in serve_line and "--host" not in serve_line


def test_serve_refuses_a_port_out_of_range_before_starting():
    result = hal0d_cli("serve", "--config", "etc/hal0d.toml", "--port", "70000")
    assert result.returncode == 2
    assert "70000 is outside 1-65535" in result.stderr


# -- 2. check-config tells the truth

def test_check_config_refuses_an_empty_file_that_would_serve_nothing(tmp_path: Path):
    path = tmp_path / "hal0d.toml"
    path.write_text("")
    result = hal0d_cli("check-config", "--config", str(path))
    assert result.returncode == 1
    assert "slots: no [[slots]] table: hal0d would serve nothing" in result.stderr
    assert "ok" not in result.stdout


def test_serve_refuses_a_config_with_no_slots_as_check_config_does(tmp_path: Path):
    path = tmp_path / "hal0d.toml"
    path.write_text("[server]\nport = 8080\n")
    result = hal0d_cli("serve", "--config", str(path))
    assert result.returncode == 1
    assert "hal0d would serve nothing" in result.stderr


def test_check_config_warns_of_a_missing_program_and_an_unset_key_variable(tmp_path: Path):
    path = tmp_path / "hal0d.toml"
    path.write_text(
        slot_toml("http://127.0.0.1:9", command=[MISSING_PROGRAM, "-m", "x.gguf"])
        + f'api_key_env = "{UNSET_VARIABLE}"\n'
    )
    result = hal0d_cli("check-config", "--config", str(path), env=env_without(UNSET_VARIABLE))
    assert result.returncode == 0, result.stderr
    assert f"warning: slots[0].command: program {MISSING_PROGRAM!r} is not found" in result.stderr
    assert f"warning: slots[0].api_key_env: the environment variable {UNSET_VARIABLE} is not set" \
        in result.stderr
    assert result.stdout.strip() == f"{path}: ok (1 slot) with 2 warnings"

    # The same file where both facts hold: no warning left.
    present = tmp_path / "bin" / MISSING_PROGRAM
    present.parent.mkdir()
    present.write_text("#!/bin/sh\n")
    present.chmod(0o755)
    path_var = f"{present.parent}:{os.environ['PATH']}"
    env = {**os.environ, UNSET_VARIABLE: "sk-test", "PATH": path_var}
    result = hal0d_cli("check-config", "--config", str(path), env=env)
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout.strip() == f"{path}: ok (1 slot)"


def test_check_config_says_slots_in_the_plural_for_two(tmp_path: Path):
    path = tmp_path / "hal0d.toml"
    second = slot_toml("http://127.0.0.1:9").replace('"llm"', '"b"').replace('"chat"', '"m2"')
    path.write_text(slot_toml("http://127.0.0.1:9") + second)
    result = hal0d_cli("check-config", "--config", str(path))
    assert result.stdout.strip() == f"{path}: ok (2 slots)", result.stderr


async def test_a_slot_whose_program_is_missing_says_why_in_api_slots_readyz_and_the_503(
    serve, tmp_path: Path, http: aiohttp.ClientSession
):
    port = free_port()
    slots = slot_toml(f"http://127.0.0.1:{free_port()}", command=[MISSING_PROGRAM])
    served = await serve(config_toml(tmp_path, port, slots), port=port)
    warnings = served.named("config.warning")
    assert [w["key"] for w in warnings] == ["slots[0].command"]
    assert MISSING_PROGRAM in warnings[0]["problem"]

    cause = f"cannot start {MISSING_PROGRAM!r}: No such file or directory"
    deadline = time.monotonic() + DEADLINE_S
    reason = None
    while time.monotonic() < deadline:
        async with http.get(f"{served.url}/api/slots") as resp:
            slot = (await resp.json())["slots"][0]
        reason = slot["reason"]
        if slot["state"] == "error":
            break
        await asyncio.sleep(0.05)
    assert reason is not None and reason.startswith(cause), reason
    assert "code None" not in reason

    async with http.get(f"{served.url}/readyz") as resp:
        assert resp.status == 503
        ready = await resp.json()
    assert ready["status"] == "not_ready"
    assert ready["slots"][0]["state"] in ("error", "starting")
    assert cause in ready["slots"][0]["reason"]

    async with http.post(f"{served.url}/v1/chat/completions",
                         json={"model": "chat", "messages": [{"role": "user", "content": "x"}]}
                         ) as resp:
        # No process of hal0d's listens on the slot's port: refused with the cause, never
        # relayed to whatever else may listen there.
        assert resp.status == 503 and hdrs.RETRY_AFTER in resp.headers
        error = (await resp.json())["error"]
    assert error["code"] == "slot.load_failed"
    assert cause in error["message"], error
    async with http.post(f"{served.url}/v1/messages",
                         json={"model": "chat", "max_tokens": 8,
                               "messages": [{"role": "user", "content": "x"}]}) as resp:
        assert resp.status == 503
        assert cause in (await resp.json())["error"]["message"]
    # Logged once at start, not again on every retry.
    assert len(served.named("config.warning")) == 1


# -- 3. print-config and --version

def test_print_config_and_check_config_read_the_same_default_path_and_fail_alike():
    if Path("/etc/hal0d/hal0d.toml").exists():
        pytest.skip("this machine has /etc/hal0d/hal0d.toml")
    printed = hal0d_cli("print-config")
    checked = hal0d_cli("check-config")
    assert printed.returncode == checked.returncode == 1
    assert printed.stderr == checked.stderr
    assert "/etc/hal0d/hal0d.toml: cannot be read" in printed.stderr
    assert printed.stdout == ""


def test_print_config_defaults_shows_the_built_in_defaults_without_a_file():
    result = hal0d_cli("print-config", "--defaults")
    assert result.returncode == 0, result.stderr
    assert "port = 8080" in result.stdout and "slots = []" in result.stdout
    both = hal0d_cli("print-config", "--defaults", "--config", "etc/hal0d.toml")
    assert both.returncode == 2  # one source or the other, never silently both


def test_version_comes_from_one_place():
    result = hal0d_cli("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"hal0d {hal0d.__version__}" == "hal0d 0.1.0"
    assert importlib.metadata.version("hal0d") == hal0d.__version__


def test_python_m_hal0d_beside_a_folder_named_hal0d_says_so_instead_of_an_import_error(
    tmp_path: Path,
):
    """From the folder that holds a clone named hal0d, Python takes the clone for the package:
    one line saying so and exit 1, not `cannot import name '__version__'`."""
    (tmp_path / "hal0d").mkdir()
    result = subprocess.run([sys.executable, "-m", "hal0d", "--version"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"hal0d: the folder {tmp_path / 'hal0d'} shadows the installed hal0d in "
        "`python -m hal0d`; run it from another folder, or use the `hal0d` command")
    elsewhere = subprocess.run([sys.executable, "-m", "hal0d", "--version"], cwd=ROOT,
                               capture_output=True, text=True, timeout=30, check=False)
    assert elsewhere.returncode == 0 and elsewhere.stdout.startswith("hal0d ")
