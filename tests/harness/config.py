"""A daemon's configuration: one builder of Config objects for an in-process hal0d (built directly,
so a test may use bounds below the TOML minimums), and the TOML text a `hal0d serve` process
reads."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any

from hal0d.config import Config, DispatcherConfig, MetricsConfig, ServerConfig, SlotConfig
from tests.harness.ports import free_port
from tests.harness.stubs import STUB_MODELS, stub_command

GRACE_S = 1.5  # config_text's [server] shutdown_grace_s
# The access tests' client keys.
KEY = "hal0-client-key-7Qx9wL"
OTHER_KEY = "hal0-second-key-Pz4"
WRONG_KEY = "hal0-wrong-key-Zz8k"
CLI_KEY = "sk-cli-test"  # the key of daemon_toml's hal0d, which the CLI tests' commands send
# A slot nothing needs to answer, for config files that are only checked.
SLOT = '[[slots]]\nname = "a"\nupstream = "http://127.0.0.1:9"\nmodels = ["m"]\n'
# Each on_demand slot serves one of the stub's own models (the stub refuses names it does not
# know).
MODEL = {"a": "chat", "b": "think-only", "c": "tool"}


def build_config(tmp_path: Path, *slots: SlotConfig, **tables: Any) -> Config:
    """The one Config builder: these slots, the history in tmp_path, and the other tables
    (`groups=`, `routes=`, `server=`, ...) as given."""
    tables.setdefault("metrics", MetricsConfig(database=str(tmp_path / "history.sqlite3")))
    return Config(slots=slots, base_dir=tmp_path, **tables)


def make_config(
    upstream: str,
    *,
    tmp_path: Path,
    models: tuple[str, ...] = STUB_MODELS,
    slot: dict[str, Any] | None = None,
    dispatcher: dict[str, Any] | None = None,
    aliases: dict[str, str] | None = None,
    extra_slots: tuple[SlotConfig, ...] = (),
    **tables: Any,
) -> Config:
    """One slot `llm` at `upstream` serving `models` (`slot`: more of its keys), then
    `extra_slots`; `dispatcher` holds [dispatcher]'s keys, `aliases` the [models] table."""
    first = SlotConfig(name="llm", upstream=upstream, models=models, **(slot or {}))
    return build_config(tmp_path, first, *extra_slots,
                     dispatcher=DispatcherConfig(**(dispatcher or {})), models=aliases or {},
                     **tables)


def keyed_config(upstream: str, tmp_path: Path, *, protect_metrics: bool = False,
                 slot_key: str | None = None, host: str = "127.0.0.1",
                 keys: tuple[str, ...] = (KEY, OTHER_KEY)) -> Config:
    """make_config's, with client keys (and `slot_key`, the key hal0d sends its upstream)."""
    server = ServerConfig(host=host, api_keys=keys, accepted_keys=frozenset(keys),
                          protect_metrics=protect_metrics)
    return make_config(upstream, tmp_path=tmp_path, slot={"api_key": slot_key}, server=server)


def on_demand(name: str, tmp_path: Path, *extra: str, **keys: Any) -> SlotConfig:
    """The slot `name` whose command is the stub (`extra`: more of its arguments), loaded by
    the first request for its model."""
    port = free_port()
    keys.setdefault("models", (MODEL[name],))
    return SlotConfig(name=name, upstream=f"http://127.0.0.1:{port}",
                      command=stub_command(port, tmp_path / f"{name}.log", *extra),
                      start="on_demand", **keys)


def config_text(stub: str, port: int, tmp_path: Path, *, grace_s: float = GRACE_S,
                slot: str = "", extra: str = "", server: str = "") -> str:
    """hal0d's config file; `slot` replaces the one slot in front of the test's stub, `server`
    lines join the [server] table."""
    slot = textwrap.dedent(slot) or textwrap.dedent(f"""
        [[slots]]
        name = "llm"
        upstream = "{stub}"
        models = ["reasoning", "chat"]
        max_concurrent = 64
    """)
    return textwrap.dedent(f"""
        [server]
        host = "127.0.0.1"
        port = {port}
        shutdown_grace_s = {grace_s}
    """) + textwrap.dedent(server) + slot + textwrap.dedent(f"""
        [metrics]
        database = "{tmp_path / 'history.sqlite3'}"

        [logging]
        format = "json"
    """) + textwrap.dedent(extra)


def daemon_toml(tmp_path: Path, port: int) -> str:
    """The CLI tests' daemon: every address, CLI_KEY, and the on-demand slot `a` (the stub)."""
    stub_port = free_port()
    command = [sys.executable, "-m", "hal0d", "stub", "--port", str(stub_port), "--delay",
               "0.005"]
    return textwrap.dedent(f"""
        [server]
        host = "0.0.0.0"
        port = {port}
        shutdown_grace_s = 1
        api_keys = ["{CLI_KEY}"]

        [metrics]
        database = "{tmp_path / 'history.sqlite3'}"

        [logging]
        format = "json"

        [[slots]]
        name = "a"
        upstream = "http://127.0.0.1:{stub_port}"
        models = ["chat"]
        command = {command!r}
        start = "on_demand"
        memory_mib = 512
    """).replace("'", '"')


def route_config(first: str, second: str, tmp_path: Path, *, route: str = "",
                 first_slot: str = "", second_slot: str = "") -> str:
    """Two slots, `one` at `first` and `two` at `second` (the stub), and the route `qwen` over
    them, each asked for the stub's `chat`."""
    return f"""
[[slots]]
name = "one"
upstream = "{first}"
models = ["one-only"]
{first_slot}

[[slots]]
name = "two"
upstream = "{second}"
models = ["two-only"]
{second_slot}

[[routes]]
model = "qwen"
slots = ["one", "two"]
served = {{ one = "chat", two = "chat" }}
{route}

[metrics]
database = "{tmp_path / 'history.sqlite3'}"
"""


def write(tmp_path: Path, text: str) -> Path:
    """`text` as the test's hal0d.toml."""
    path = tmp_path / "hal0d.toml"
    path.write_text(text)
    return path
