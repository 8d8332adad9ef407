"""print-config keeps the secrets written in the file out of its output (it is pasted into
issues and chats): each prints as "<redacted>", which check-config and serve refuse until the
secret is put back, so a printed file never runs with the placeholder as a key; put back, it
loads to the same configuration and serves with those keys."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import aiohttp
import pytest

from hal0d import config as configuration
from tests.harness.client import chat_body
from tests.harness.daemons import ServerFactory
from tests.harness.stubs import Stub

ROOT = Path(__file__).resolve().parents[1]
SERVER_SECRET = "hal0-print-test-server-Jm3xv"
KEY_SECRET = "hal0-print-test-key-Tq8rb"
SLOT_SECRET = "sk-print-test-slot-Wn5yh"
ENV_SECRET = "hal0-print-test-env-Ae2uc"


def hal0d_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hal0d", *args], capture_output=True, text=True,
                          timeout=30, cwd=ROOT, env=env)


def written(stub: str, tmp_path: Path) -> str:
    return textwrap.dedent(f"""
        [server]
        api_keys = ["{SERVER_SECRET}"]

        [[keys]]
        name = "laptop"
        key = "{KEY_SECRET}"
        scopes = ["inference"]

        [[keys]]
        name = "phone"
        key_env = "HAL0D_PRINT_TEST_KEY"
        scopes = ["read"]

        [[slots]]
        name = "llm"
        upstream = "{stub}"
        models = ["chat"]
        api_key = "{SLOT_SECRET}"

        [metrics]
        database = "{tmp_path / 'history.sqlite3'}"
    """)


async def test_print_config_redacts_the_written_secrets_and_check_config_wants_them_back(
        start_hal0d: ServerFactory, stub: Stub, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HAL0D_PRINT_TEST_KEY", ENV_SECRET)
    env = dict(os.environ)
    original = tmp_path / "hal0d.toml"
    original.write_text(written(stub.url, tmp_path))
    printed = hal0d_cli("print-config", "--config", str(original), env=env)
    assert printed.returncode == 0, printed.stderr
    for secret in (SERVER_SECRET, KEY_SECRET, SLOT_SECRET, ENV_SECRET):
        assert secret not in printed.stdout
    assert printed.stdout.count('"<redacted>"') == 3
    assert printed.stdout.startswith("# Secrets written in the file print as <redacted>: put")
    assert 'key_env = "HAL0D_PRINT_TEST_KEY"' in printed.stdout  # a name, not a secret

    copy = tmp_path / "printed.toml"
    copy.write_text(printed.stdout)
    for command in ("check-config", "serve"):
        refused = hal0d_cli(command, "--config", str(copy), env=env)
        assert refused.returncode == 1
        assert refused.stderr.splitlines() == [
            "server.api_keys: '<redacted>' is what print-config writes in place of a key: put "
            "the keys back (or use api_keys_file)",
            "keys[0].key: '<redacted>' is what print-config writes in place of a secret: put the "
            'key back (or use key_env, key_file) (key "laptop")',
            "slots[0].api_key: '<redacted>' is what print-config writes in place of a secret: "
            'put the key back (or use api_key_env) (slot "llm")',
        ], refused.stderr

    restored = (printed.stdout.replace('    "<redacted>",', f'    "{SERVER_SECRET}",')
                .replace('api_key = "<redacted>"', f'api_key = "{SLOT_SECRET}"')
                .replace('key = "<redacted>"', f'key = "{KEY_SECRET}"'))
    copy.write_text(restored)
    assert hal0d_cli("check-config", "--config", str(copy), env=env).returncode == 0
    loaded = configuration.load(copy)
    assert loaded == configuration.load(original)

    hal0d = await start_hal0d(stub.url, config=loaded)
    async with aiohttp.ClientSession() as http:
        for secret, status in ((KEY_SECRET, 200), ("<redacted>", 401)):
            async with http.post(hal0d.make_url("/v1/chat/completions"),
                                 json=chat_body("chat", stream=False),
                                 headers={"Authorization": f"Bearer {secret}"}) as resp:
                assert resp.status == status, await resp.text()


def test_the_starter_config_points_to_the_ollama_docs_where_they_are() -> None:
    starter = (ROOT / "etc/hal0d.starter.toml").read_text()
    assert 'README "The Ollama API"' not in starter
    assert "See docs/ollama.md." in starter and (ROOT / "docs/ollama.md").exists()
