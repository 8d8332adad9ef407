"""The Codex CLI against hal0d: `codex exec` with a model provider whose base_url is hal0d and
`wire_api = "responses"`, in front of a stub that serves only chat completions
(`responses = "translate"`).

Codex is the npm package @openai/codex, installed into .npm-test/ by `make test` when npm is
there (the Makefile's npm-test-tools); HAL0D_CODEX names another binary. It runs with a CODEX_HOME
of its own (its config.toml names the provider), in a scratch folder that is no git repository
(--skip-git-repo-check), with no sandbox and no approvals, so that it runs the stub's shell
command by itself. Its `--json` lines are what the assertions read: the turn completed, the
agent's message, and the command it ran.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp.test_utils import TestServer

from hal0d_stub.app import make_stub_app
from hal0d_stub.models import CONTENT_TEXT, SHELL_ANSWER, SHELL_OUTPUT
from hal0d_stub.slots import SlotOptions
from tests.harness.ports import free_port
from tests.harness.stubs import Stub

ROOT = Path(__file__).resolve().parents[1]
INSTALLED = ROOT / ".npm-test" / "node_modules" / ".bin" / "codex"
TURN_TIMEOUT_S = 45.0


def codex_binary() -> str:
    given = os.environ.get("HAL0D_CODEX")
    if given:
        return given
    if INSTALLED.exists():
        return str(INSTALLED)
    if shutil.which("npm") is None:
        pytest.skip("the Codex CLI test needs npm (to install @openai/codex); none is on PATH")
    pytest.skip(f"the Codex CLI is not installed at {INSTALLED.relative_to(ROOT)}: run "
                "`make npm-test-tools` (make test does), or set HAL0D_CODEX")


@pytest.fixture
async def hal0d(aiohttp_server: Any, start_hal0d: Any, tmp_path: Path) -> TestServer:
    log = tmp_path / f"stub-{free_port()}.log"
    # Codex's instructions and tools are thousands of words: a context to hold them, as an
    # agent's model has (the stub's default, 4096 of its word tokens, refuses them).
    options = SlotOptions(ctx_size=1 << 18)
    stub = Stub(await aiohttp_server(make_stub_app(log, 0.001, chat_only=True,
                                                   slot_options=options)), log)
    return await start_hal0d(stub.url, slot={"responses": "translate"})


def codex_home(tmp_path: Path, hal0d: TestServer) -> Path:
    home = tmp_path / "codex-home"
    home.mkdir()
    (home / "config.toml").write_text(
        'model_provider = "hal0d"\n'
        "[model_providers.hal0d]\n"
        'name = "hal0d"\n'
        f'base_url = "{hal0d.make_url("/v1")}"\n'
        'wire_api = "responses"\n'
        'env_key = "HAL0D_API_KEY"\n'
    )
    return home


async def codex_exec(tmp_path: Path, hal0d: TestServer, model: str,
                     prompt: str) -> tuple[list[dict[str, Any]], Path]:
    """One `codex exec` turn; its JSON events and the folder it worked in."""
    binary = codex_binary()
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path),
           "CODEX_HOME": str(codex_home(tmp_path, hal0d)), "HAL0D_API_KEY": "unused"}
    process = await asyncio.create_subprocess_exec(
        binary, "exec", "--json", "--skip-git-repo-check", "--sandbox", "danger-full-access",
        "-C", str(work), "-m", model, prompt,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env=env, start_new_session=True,
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), TURN_TIMEOUT_S)
    except TimeoutError:
        os.killpg(process.pid, signal.SIGKILL)
        await process.wait()
        raise AssertionError(f"codex exec did not finish within {TURN_TIMEOUT_S} s") from None
    assert process.returncode == 0, f"codex exec exited {process.returncode}: {err.decode()}"
    return [orjson.loads(line) for line in out.splitlines() if line.startswith(b"{")], work


def completed(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [event["item"] for event in events
            if event["type"] == "item.completed" and event["item"]["type"] == kind]


async def test_a_codex_turn_completes_with_the_stubs_text(hal0d: TestServer,
                                                          tmp_path: Path) -> None:
    events, _ = await codex_exec(tmp_path, hal0d, "chat", "say hi")
    assert events[-1]["type"] == "turn.completed", events
    assert [item["text"] for item in completed(events, "agent_message")] == [CONTENT_TEXT]
    assert events[-1]["usage"]["output_tokens"] > 0


async def test_codex_runs_the_shell_command_the_model_asks_for_and_answers(
    hal0d: TestServer, tmp_path: Path
) -> None:
    events, work = await codex_exec(tmp_path, hal0d, "shell", "run the command")
    assert events[-1]["type"] == "turn.completed", events
    (command,) = completed(events, "command_execution")
    assert command["exit_code"] == 0 and command["aggregated_output"].strip() == SHELL_OUTPUT
    assert (work / "hal0d-shell.txt").read_text().strip() == SHELL_OUTPUT
    (message,) = completed(events, "agent_message")
    # The stub's second answer quotes the tool result Codex sent back.
    assert message["text"].startswith(SHELL_ANSWER) and SHELL_OUTPUT in message["text"]
