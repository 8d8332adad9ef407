"""Configuration: every problem named by its key path; the CLI's check-config and print-config."""

from __future__ import annotations

import textwrap
import tomllib
from pathlib import Path

import pytest

from hal0d import config
from tests.harness.cli import hal0d_cli
from tests.harness.config import SLOT, write


@pytest.mark.parametrize(
    ("toml", "problem"),
    [
        ("[dispatcher]\ndirect_read_timeout_s = 700\n",
         "dispatcher.direct_read_timeout_s: 700.0 is outside 30.0-600.0"),
        ("[dispatcher]\nstream_total_timeout_s = 90000\n",
         "dispatcher.stream_total_timeout_s: 90000.0 is outside 0.0-86400.0"),
        ("[dispatcher]\nstream_idle_timeout_s = -1\n",
         "dispatcher.stream_idle_timeout_s: -1.0 is outside 0.0-86400.0"),
        ('[server]\nport = "8080"\n', "server.port: '8080' is not an integer"),
        ("[server]\nport = 70000\n", "server.port: 70000 is outside 1-65535"),
        ("[server]\nhots = 1\n", "server.hots: unknown key"),
        ("[servr]\n", "servr: unknown section"),
        ("[dispatcher]\nconnect_timeout_s = true\n",
         "dispatcher.connect_timeout_s: True is not a number"),
        (SLOT + "max_concurrent = 0\n", "slots[0].max_concurrent: 0 is outside 1-4096"),
        (SLOT + "colour = 1\n", "slots[0].colour: unknown key"),
        ('[[slots]]\nname = "a"\nmodels = ["m"]\n', "slots[0].upstream: is required"),
        (SLOT.replace("http://", "ftp://"), "slots[0].upstream: 'ftp://127.0.0.1:9' must start"),
        (SLOT + SLOT, "slots[1].name: 'a' is used by another slot"),
        (SLOT + "models = []\n", "invalid TOML"),
        (SLOT.replace('["m"]', "[]"), "slots[0].models: must be a non-empty list"),
        (SLOT + '[models]\n"claude-*" = "nope"\n', "'nope' is not a model any slot serves"),
        ('[logging]\nformat = "xml"\n', "logging.format: 'xml' is not one of"),
        (SLOT + 'capabilities = ["thinking", "reasoning"]\n',
         "slots[0].capabilities: 'reasoning' is not a capability (any of completion, tools"),
        (SLOT + 'capabilities = { other = ["tools"] }\n',
         "slots[0].capabilities.other: not a model of this slot (its models: m)"),
        (SLOT + 'capabilities = { m = [] }\n',
         "slots[0].capabilities.m: must be a non-empty list of capabilities"),
        (SLOT + 'capabilities = "tools"\n',
         "slots[0].capabilities: 'tools' is not a list of capabilities nor a table of them"),
    ],
)
def test_bad_values_are_reported_with_their_key_path(tmp_path, toml, problem):
    with pytest.raises(config.ConfigError) as caught:
        config.load(write(tmp_path, toml))
    assert any(problem in p for p in caught.value.problems), caught.value.problems


def test_every_problem_is_reported_at_once(tmp_path):
    toml = "[server]\nport = 0\nhost = 1\n[dispatcher]\ndirect_read_timeout_s = 1\n"
    with pytest.raises(config.ConfigError) as caught:
        config.load(write(tmp_path, toml))
    assert len(caught.value.problems) == 3


def test_fractional_stream_bounds_are_valid(tmp_path):
    toml = "[dispatcher]\nstream_total_timeout_s = 0.5\nstream_idle_timeout_s = 0.25\n"
    loaded = config.load(write(tmp_path, toml))
    assert loaded.dispatcher.stream_idle_timeout_s == 0.25


def test_check_config_exits_1_naming_every_key_path(tmp_path):
    path = write(tmp_path, "[dispatcher]\ndirect_read_timeout_s = 700\n[server]\nport = -1\n")
    result = hal0d_cli("check-config", "--config", str(path))
    assert result.returncode == 1
    assert "dispatcher.direct_read_timeout_s: 700.0 is outside 30.0-600.0" in result.stderr
    assert "server.port: -1 is outside 1-65535" in result.stderr


def test_check_config_accepts_the_shipped_example():
    result = hal0d_cli("check-config", "--config", "etc/hal0d.toml")
    assert result.returncode == 0, result.stderr


def test_print_config_fills_defaults_and_round_trips(tmp_path):
    path = write(tmp_path, SLOT)
    result = hal0d_cli("print-config", "--config", str(path))
    assert result.returncode == 0, result.stderr
    printed = tomllib.loads(result.stdout)
    assert printed["dispatcher"]["stream_total_timeout_s"] == 900.0
    assert printed["slots"][0]["max_concurrent"] == 8
    again = tmp_path / "printed.toml"
    again.write_text(result.stdout)
    assert config.load(again) == config.load(path)


def test_capabilities_read_as_a_list_for_every_model_or_per_model_and_round_trip(tmp_path):
    slot = SLOT.replace('["m"]', '["m", "e"]')
    for written in ('capabilities = ["tools", "thinking"]',
                    'capabilities = { m = ["thinking", "tools"], e = ["embedding"] }'):
        path = write(tmp_path, slot + written + "\n")
        [loaded] = config.load(path).slots
        assert loaded.declared_capabilities("m") == ("tools", "thinking")  # Ollama's order
        result = hal0d_cli("print-config", "--config", str(path))
        assert result.returncode == 0, result.stderr
        again = tmp_path / "printed.toml"
        again.write_text(result.stdout)
        assert config.load(again) == config.load(path)
    assert loaded.declared_capabilities("e") == ("embedding",)
    [undeclared] = config.load(write(tmp_path, SLOT)).slots
    assert undeclared.declared_capabilities("m") is None


def test_print_config_round_trips_the_anonymous_tables_and_durations_as_seconds(tmp_path):
    path = write(tmp_path, SLOT + 'queue_timeout_s = "2m"\n' + textwrap.dedent("""
        [server]
        api_keys_file = "keys.txt"
        anonymous = { scopes = ["inference", "read"], models = ["m"] }

        [ollama]
        listen = "0.0.0.0:11434"
        anonymous = { scopes = ["inference"], networks = ["192.168.1.7/24", "fd00::/8"] }
    """))
    (tmp_path / "keys.txt").write_text("a-key-from-a-file\n")
    result = hal0d_cli("print-config", "--config", str(path))
    assert result.returncode == 0, result.stderr
    printed = tomllib.loads(result.stdout)
    assert printed["slots"][0]["queue_timeout_s"] == 120.0
    assert printed["ollama"]["anonymous"] == {"scopes": ["inference"],
                                              "networks": ["192.168.1.0/24", "fd00::/8"],
                                              "class": "interactive", "weight": 1.0}
    again = tmp_path / "printed.toml"
    again.write_text(result.stdout)
    assert config.load(again) == config.load(path)


def test_relative_database_resolves_against_the_config_folder(tmp_path):
    loaded = config.load(write(tmp_path, '[metrics]\ndatabase = "h.sqlite3"\n'))
    assert loaded.database_path() == tmp_path / "h.sqlite3"


def test_alias_globs_and_exact_names():
    aliases = {"claude-*": "reasoning", "claude-exact": "chat"}
    assert config.alias_target(aliases, "claude-sonnet-4") == "reasoning"
    assert config.alias_target(aliases, "claude-exact") == "chat"
    assert config.alias_target(aliases, "gpt-4") is None


def test_free_port_is_one_port_of_the_slots_own_in_its_upstream_and_command(
    tmp_path: Path,
) -> None:
    import socket

    def slots(folder: Path) -> tuple[config.SlotConfig, ...]:
        return config.parse({"slots": [{
            "name": "demo", "upstream": "http://127.0.0.1:{free_port}", "models": ["m"],
            "command": ["hal0d", "stub", "--port", "{free_port}"],
        }]}, base_dir=folder).slots

    [slot] = slots(tmp_path)
    port = int(slot.upstream.rsplit(":", 1)[1])
    assert slot.command == ("hal0d", "stub", "--port", str(port))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))  # free: nothing listens there
    assert slots(tmp_path) == (slot,)  # read again (a reload): the same port
    [other] = slots(tmp_path / "elsewhere")
    assert other.upstream != slot.upstream
    # Below the ports Linux gives outgoing connections: between the pick and the slot's process
    # binding it, no connection on the machine can take it (a CI run once lost a bind so).
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert 1024 <= port < ephemeral_low


def test_pool_timeout_s_bounds_nothing_so_only_its_default_loads(tmp_path):
    """hal0d's upstream pool has no connection limit: no request waits for a connection, and a
    pool_timeout_s of its own is refused naming the key, where it once loaded and did nothing.
    Its default loads: print-config writes it."""
    with pytest.raises(config.ConfigError) as caught:
        config.load(write(tmp_path, SLOT + "[dispatcher]\npool_timeout_s = 2.0\n"))
    assert caught.value.problems == [
        "dispatcher.pool_timeout_s: 2.0 has no effect: hal0d's upstream pool has no connection "
        "limit, so a request never waits for a connection (it waits for its slot, in the "
        "slot's queue: queue_timeout_s); remove the key"]
    loaded = config.load(write(tmp_path, SLOT + "[dispatcher]\npool_timeout_s = 5.0\n"))
    assert loaded.dispatcher == config.DispatcherConfig()
