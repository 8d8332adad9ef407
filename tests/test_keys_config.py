"""Scoped keys ([[keys]]) in the config: check-config's refusals (a key without a scope, two of one
name, an empty secret, a secret another key has), never showing a secret; key_env and key_file
read their secrets, and print-config hides them."""

from __future__ import annotations

import textwrap
import tomllib
from pathlib import Path

import pytest

from hal0d.config import ConfigError, parse


def refusals(text: str, tmp_path: Path) -> list[str]:
    with pytest.raises(ConfigError) as refused:
        parse(tomllib.loads(textwrap.dedent(text)), base_dir=tmp_path)
    return refused.value.problems


def test_check_config_refuses_a_key_without_scope_two_keys_of_one_name_and_an_empty_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "empty.key").write_text("\n")
    monkeypatch.setenv("HAL0D_TEST_EMPTY_KEY", "")
    problems = refusals("""
        [[keys]]
        name = "a"
        key = "secret-of-a-123"

        [[keys]]
        name = "b"
        key = "secret-of-b-456"
        scopes = []

        [[keys]]
        name = "a"
        key = "secret-of-a2-789"
        scopes = ["read"]

        [[keys]]
        name = "c"
        key = "  "
        scopes = ["read"]

        [[keys]]
        name = "d"
        key_file = "empty.key"
        scopes = ["read"]

        [[keys]]
        name = "e"
        key_env = "HAL0D_TEST_EMPTY_KEY"
        scopes = ["read"]

        [[keys]]
        name = "f"
        scopes = ["write"]
        key = "secret-of-a-123"
        key_env = "HOME"
    """, tmp_path)
    assert problems == [
        'keys[0].scopes: is required (any of inference, read, admin) (key "a")',
        "keys[1].scopes: [] must list at least one of inference, read, admin (key \"b\")",
        "keys[2].name: 'a' is used by another key (key \"a\")",
        'keys[3].key: the secret is empty (key "c")',
        'keys[4].key_file: the secret is empty (key "d")',
        "keys[5].key_env: the environment variable 'HAL0D_TEST_EMPTY_KEY' is unset or empty "
        '(key "e")',
        "keys[6].scopes: 'write' is not a scope (scopes: inference, read, admin) (key \"f\")",
        'keys[6]: needs exactly one of key, key_env, key_file (has key, key_env) (key "f")',
    ], problems
    for problem in problems:
        assert "secret-of" not in problem


def test_a_key_whose_secret_another_key_has_is_refused_without_showing_it(
    tmp_path: Path,
) -> None:
    problems = refusals("""
        [server]
        api_keys = ["shared-secret-0042"]

        [[keys]]
        name = "mine"
        key = "shared-secret-0042"
        scopes = ["read"]
    """, tmp_path)
    assert problems == ["keys[0]: its secret is also server.api_keys's; every key needs its "
                        'own (key "mine")']


def test_key_env_and_key_file_read_their_secrets_and_print_config_hides_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hal0d.config import to_toml

    monkeypatch.setenv("HAL0D_TEST_KEY", " from-the-environment-77 ")
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(tmp_path / "credentials"))
    (tmp_path / "credentials").mkdir()
    (tmp_path / "credentials" / "phone").write_text("from-a-credential-88\n")
    config = parse(tomllib.loads(textwrap.dedent("""
        [[keys]]
        name = "laptop"
        key_env = "HAL0D_TEST_KEY"
        scopes = ["inference"]
        models = ["plain*", "qwen-?b"]
        max_concurrent = 2

        [[keys]]
        name = "phone"
        key_file = "${CREDENTIALS_DIRECTORY}/phone"
        scopes = ["read", "read", "inference"]
    """)), base_dir=tmp_path)
    laptop, phone = config.keys
    assert (laptop.secret, laptop.models, laptop.max_concurrent) == (
        "from-the-environment-77", ("plain*", "qwen-?b"), 2)
    assert (phone.secret, phone.scopes) == ("from-a-credential-88", ("read", "inference"))
    printed = to_toml(config)
    assert "from-the-environment-77" not in printed and "from-a-credential-88" not in printed
    again = parse(tomllib.loads(printed), base_dir=tmp_path)
    assert again.keys == config.keys
