"""A shared box's config as check-config reads it: an unknown class, a weight of 0 and an hourly
quota above the daily one are refused, each named with its key; a quota below what one request
may use on a model the key reaches is warned of; print-config writes `class` back as it was
read."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def check_config(tmp_path: Path, keys: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "hal0d.toml"
    path.write_text(textwrap.dedent(keys) + textwrap.dedent(f"""
        [[slots]]
        name = "chat"
        upstream = "http://127.0.0.1:9"
        models = ["qwen"]
        context = 8192

        [[slots]]
        name = "embed"
        upstream = "http://127.0.0.1:9"
        models = ["nomic"]
        context = 2048

        [metrics]
        database = "{tmp_path / 'history.sqlite3'}"
    """))
    return subprocess.run([sys.executable, "-m", "hal0d", "check-config", "--config", str(path)],
                          capture_output=True, text=True, timeout=30, cwd=ROOT)


def test_an_unknown_class_a_zero_weight_and_an_hour_above_the_day_are_named(
        tmp_path: Path) -> None:
    result = check_config(tmp_path, """
        [[keys]]
        name = "nightly"
        key = "sk-nightly-1"
        scopes = ["inference"]
        class = "bulk"
        weight = 0

        [[keys]]
        name = "kid"
        key = "sk-kid-2"
        scopes = ["inference"]
        tokens_per_hour = 20000
        tokens_per_day = 10000
    """)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "keys[0].class: 'bulk' is not a class (classes: interactive, batch) (key \"nightly\")",
        "keys[0].weight: 0 would never be served beside other keys of its class; a weight is "
        "above 0 (1 is the default, 0.1 a tenth of it) (key \"nightly\")",
        "keys[1].tokens_per_hour: 20000 is more than its tokens_per_day, 10000: the day's quota "
        "would end every hour's first (key \"kid\")",
    ]


def test_a_quota_below_one_requests_max_tokens_is_warned_of_where_the_key_reaches(
        tmp_path: Path) -> None:
    result = check_config(tmp_path, """
        [[keys]]
        name = "kid"
        key = "sk-kid-2"
        scopes = ["inference"]
        tokens_per_hour = 4000

        [[keys]]
        name = "indexer"
        key = "sk-indexer-3"
        scopes = ["inference"]
        models = ["nomic"]
        class = "batch"
        tokens_per_day = 4000

        [server.anonymous]
        scopes = ["inference"]
        class = "batch"
        weight = 0.5
    """)
    assert result.returncode == 0, result.stderr
    # The kid may reach the chat model, whose context is 8192: one request may be past 4000.
    # The indexer reaches only the embedder's 2048.
    assert result.stderr.splitlines() == [
        "warning: keys[0].tokens_per_hour: 4000 is below one request's max_tokens on slot "
        "'chat' (up to its context, 8192 tokens): a single request may use the whole quota (it "
        "finishes; the key's next requests are refused until it resets)"]
    printed = subprocess.run(
        [sys.executable, "-m", "hal0d", "print-config", "--config", str(tmp_path / "hal0d.toml")],
        capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert printed.returncode == 0, printed.stderr
    written = tomllib.loads(printed.stdout)
    assert written["keys"][1]["class"] == "batch" and written["keys"][0]["class"] == "interactive"
    assert written["server"]["anonymous"]["class"] == "batch"
    assert written["server"]["anonymous"]["weight"] == 0.5
