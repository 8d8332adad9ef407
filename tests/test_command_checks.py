"""check-config reads a slot's command as the machine will run it: a model file a known server
is told to load that is not there, and llama-server's context so thin per request (all of
-c with one server slot, split between `--parallel` slots) that an agent's prompt overflows,
are warnings (check-config exits 0, `serve`
logs them once and serves: the machine may still change before the service starts). Another
program's `-m` (Python's own) and an argument with a placeholder are left alone."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import aiohttp
import orjson

from tests.harness.client import chat_body
from tests.harness.daemons import STARTUP_S, Hal0dProcessFactory
from tests.harness.ports import free_port
from tests.harness.stubs import Stub

ROOT = Path(__file__).resolve().parents[1]


def llama_server(folder: Path) -> Path:
    """A stand-in named llama-server: hal0d's stub, which has llama-server's -c and -np, told
    the model to load and loading none."""
    program = folder / "bin" / "llama-server"
    program.parent.mkdir()
    program.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import sys
        from hal0d.cli.commands import main
        args = sys.argv[1:]
        while "-m" in args:
            del args[args.index("-m"):args.index("-m") + 2]
        sys.exit(main(["stub", *args]))
    """))
    program.chmod(0o755)
    return program


def slot(name: str, model: str, command: list[str], port: int | None = None) -> str:
    upstream = f"http://127.0.0.1:{port or free_port()}"
    return textwrap.dedent(f"""
        [[slots]]
        name = "{name}"
        upstream = "{upstream}"
        models = ["{model}"]
        command = {orjson.dumps(command).decode()}
    """)


def thin_slot(program: Path, missing: Path, port: int) -> str:
    return slot("thin", "chat", [str(program), "-m", str(missing), "--alias", "chat", "--host",
                                 "127.0.0.1", "--port", str(port), "-c", "4096", "-np", "2"], port)


def warnings_of(missing: Path, index: int = 0) -> list[str]:
    return [
        f"warning: slots[{index}].command: model file {str(missing)!r} (-m) does not exist; the "
        "slot's process cannot load it",
        f"warning: slots[{index}].command: llama-server splits -c 4096 between its --parallel 2 "
        "slots: 2048 tokens per request, below 8192 (a coding agent's first prompt alone can be "
        "larger); raise -c to 16384 or more, or lower --parallel",
    ]


def test_check_config_warns_of_a_missing_model_file_and_a_thin_context_per_slot(
        tmp_path: Path) -> None:
    program, model = llama_server(tmp_path), tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    missing = tmp_path / "typo.gguf"
    path = tmp_path / "hal0d.toml"
    path.write_text(
        thin_slot(program, missing, free_port())
        # Well set: a model that is there, 8192 tokens a request, a placeholder left alone.
        + slot("wide", "tool", [str(program), "-m", str(model), "-a", "tool", "-c", "32768",
                                "-np", "4", "--mmproj", "{models}/mmproj.gguf"])
        # llama-cpp-python's --model is read; Python's own -m is a module, not a model.
        + slot("py", "think-only", [sys.executable, "-m", "llama_cpp.server", "--model",
                                    str(tmp_path / "gone.gguf")])
        + slot("stub", "reasoning", [sys.executable, "-m", "hal0d", "stub"])
        + f'\n[metrics]\ndatabase = "{tmp_path / "history.sqlite3"}"\n')
    result = subprocess.run([sys.executable, "-m", "hal0d", "check-config", "--config", str(path)],
                            capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        *warnings_of(missing),
        f"warning: slots[2].command: model file {str(tmp_path / 'gone.gguf')!r} (--model) does "
        "not exist; the slot's process cannot load it",
    ], result.stderr
    assert result.stdout.strip() == f"{path}: ok (4 slots) with 3 warnings"

    if os.geteuid() != 0:  # root reads any file
        model.chmod(0)
        again = subprocess.run([sys.executable, "-m", "hal0d", "check-config", "--config",
                                str(path)], capture_output=True, text=True, timeout=30, cwd=ROOT)
        assert f"model file {str(model)!r} (-m) is not readable by this user" in again.stderr


async def test_serve_logs_the_same_warnings_once_and_serves(
        start_hal0d_process: Hal0dProcessFactory, stub: Stub, tmp_path: Path) -> None:
    port, missing = free_port(), tmp_path / "typo.gguf"
    hal0d = await start_hal0d_process(stub.url,
                                      slot=thin_slot(llama_server(tmp_path), missing, port))
    logged = hal0d.named("config.warning")
    assert [f"warning: {w['key']}: {w['problem']}" for w in logged] == warnings_of(missing)
    async with asyncio.timeout(STARTUP_S), aiohttp.ClientSession() as http, http.post(
            f"{hal0d.url}/v1/chat/completions", json=chat_body("chat", stream=False)) as resp:
        assert resp.status == 200, await resp.text()  # warned, not refused


def test_check_config_warns_of_a_thin_context_with_one_server_slot(tmp_path: Path) -> None:
    """With one server slot (`--parallel 1`, or none given) each request has all of -c: under
    8192 is as thin as a split one; `--kv-unified` gives every slot all of it too."""
    program = llama_server(tmp_path)
    path = tmp_path / "hal0d.toml"
    path.write_text(
        slot("one", "chat", [str(program), "-c", "4096", "--parallel", "1"])
        + slot("default", "tool", [str(program), "--ctx-size=2048"])
        + slot("unified", "think", [str(program), "-c", "4096", "-np", "4", "-kvu"])
        + slot("wide", "wide", [str(program), "-c", "8192"])
        + f'\n[metrics]\ndatabase = "{tmp_path / "history.sqlite3"}"\n')
    result = subprocess.run([sys.executable, "-m", "hal0d", "check-config", "--config", str(path)],
                            capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        f"warning: slots[{index}].command: llama-server gives each request -c {context} "
        "tokens, below 8192 (a coding agent's first prompt alone can be larger); raise -c to "
        "8192 or more" for index, context in ((0, 4096), (1, 2048), (2, 4096))
    ], result.stderr


def test_check_config_warns_of_a_llama_server_that_answers_under_another_name(
        tmp_path: Path) -> None:
    """hal0d relays /v1 answers byte for byte, so their `model` is what llama-server calls
    itself: its model file's path without --alias, else the first of its aliases in sorted
    order. A name other than the slot's is warned of; an alias the slot serves, or one from
    LLAMA_ARG_ALIAS in hal0d's environment (which the server inherits), is not."""
    program, model = llama_server(tmp_path), tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    path = tmp_path / "hal0d.toml"
    path.write_text(
        slot("bare", "chat", [str(program), "-m", str(model), "-c", "8192"])
        + slot("other", "tool", [str(program), "-m", str(model), "-c", "8192", "-a", "tool,a-b"])
        + slot("named", "named", [str(program), "-m", str(model), "-c", "8192",
                                  "--alias=named,other-name"])
        + f'\n[metrics]\ndatabase = "{tmp_path / "history.sqlite3"}"\n')
    command = [sys.executable, "-m", "hal0d", "check-config", "--config", str(path)]
    environ = {key: value for key, value in os.environ.items() if key != "LLAMA_ARG_ALIAS"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=30, cwd=ROOT,
                            env=environ)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        f"warning: slots[0].command: llama-server answers \"model\": {str(model)!r}, not the "
        "name clients ask for ('chat'); add \"--alias\", \"chat\" to the command (with "
        "several names it answers under the first in sorted order)",
        "warning: slots[1].command: llama-server answers \"model\": 'a-b', not the name clients "
        "ask for ('tool'); add \"--alias\", \"tool\" to the command (with several names it "
        "answers under the first in sorted order)",
    ], result.stderr
    inherited = subprocess.run(command, capture_output=True, text=True, timeout=30, cwd=ROOT,
                               env={**environ, "LLAMA_ARG_ALIAS": "chat"})
    assert "slots[0]" not in inherited.stderr and "slots[1]" in inherited.stderr
