"""The model-lifecycle keys: `start`, `idle_unload_s`, `load_timeout_s`, `group`, `memory_mib` on
a slot, and `[groups.NAME]`; each impossible combination named by its key path."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from hal0d import config
from tests.harness.cli import hal0d_cli
from tests.harness.config import write


def slot(name: str, *, command: bool = True, **keys: object) -> str:
    lines = [f'[[slots]]\nname = "{name}"\nupstream = "http://127.0.0.1:9"\n'
             f'models = ["{name}-model"]\n']
    if command:
        lines.append('command = ["llama-server", "--port", "9"]\n')
    for key, value in keys.items():
        lines.append(f"{key} = {value!r}\n".replace("'", '"'))
    return "".join(lines)


GPU = '[groups.gpu0]\nmax_loaded = 1\nmemory_mib = 10240\n'


@pytest.mark.parametrize(
    ("toml", "problem"),
    [
        (slot("a", start="sometimes"), "slots[0].start: 'sometimes' is not one of"),
        (slot("a", command=False, start="on_demand"),
         "slots[0].start: 'on_demand' needs a command"),
        (slot("a", command=False, idle_unload_s=60),
         "slots[0].idle_unload_s: only for a slot with a command"),
        (GPU + slot("a", command=False, group="gpu0", memory_mib=100),
         "slots[0].group: only for a slot with a command"),
        (slot("a", command=False, load_timeout_s=60),
         "slots[0].load_timeout_s: only for a slot with a command"),
        (slot("a", idle_unload_s=60),
         "slots[0].idle_unload_s: only for start = 'on_demand'"),
        (slot("a", start="on_demand", max_queue=0),
         "slots[0].max_queue: 0 leaves no place for the request that loads"),
        (slot("a", start="on_demand", idle_unload_s=-1), "slots[0].idle_unload_s: -1.0 is outside"),
        (slot("a", load_timeout_s=0), "slots[0].load_timeout_s: 0.0 is outside"),
        (slot("a", group="gpu9"), "slots[0].group: 'gpu9' is not a [groups] table"),
        (GPU + slot("a", group="gpu0"),
         "slots[0].memory_mib: is required in group 'gpu0'"),
        (GPU + slot("a", group="gpu0", memory_mib=12000, start="on_demand"),
         "slots[0].memory_mib: 12000 MiB exceeds the budget of group 'gpu0' (10240 MiB)"),
        (GPU + slot("a"), "groups.gpu0: no slot names this group"),
        (GPU + slot("a", group="gpu0", memory_mib=4096)
         + slot("b", group="gpu0", memory_mib=4096),
         "groups.gpu0.max_loaded: 1 is fewer than its 2 slots with start = 'always'"),
        ('[groups.gpu0]\nmemory_mib = 10240\n' + slot("a", group="gpu0", memory_mib=6144)
         + slot("b", group="gpu0", memory_mib=6144),
         "groups.gpu0.memory_mib: 10240 MiB is less than the 12288 MiB"),
        ('[groups.gpu0]\nfree_memory_command = []\n' + slot("a", group="gpu0", memory_mib=1),
         "groups.gpu0.free_memory_command: must be a non-empty list"),
        ('[groups.gpu0]\nmax_loaded = 0\n' + slot("a", group="gpu0"),
         "groups.gpu0.max_loaded: 0 is outside 1-4096"),
        ('[groups.gpu0]\nslots = 1\n' + slot("a", group="gpu0"),
         "groups.gpu0.slots: unknown key"),
        ('[groups.gpu0]\nmax_loaded = 1\npolicy = "lru"\n' + slot("a", group="gpu0"),
         "groups.gpu0.policy: 'lru' is not one of ('batch', 'fifo')"),
        ('[groups.gpu0]\nmax_loaded = 1\nmax_wait_s = 0.05\n' + slot("a", group="gpu0"),
         "groups.gpu0.max_wait_s: 0.05 is outside 0.1-3600"),
        ('[groups.gpu0]\nmax_loaded = 1\nmax_wait_s = 7200\n' + slot("a", group="gpu0"),
         "groups.gpu0.max_wait_s: 7200.0 is outside 0.1-3600"),
        ('[groups.gpu0]\nmax_loaded = 1\nmin_turn_loads = -1\n' + slot("a", group="gpu0"),
         "groups.gpu0.min_turn_loads: -1.0 is outside 0.0-100.0"),
        ('[groups.gpu0]\nmax_loaded = 1\nmax_swap_share = 0\n' + slot("a", group="gpu0"),
         "groups.gpu0.max_swap_share: 0.0 is outside 0.01-0.9"),
        ('[groups.gpu0]\nmax_loaded = 1\nmax_swap_share = 1\n' + slot("a", group="gpu0"),
         "groups.gpu0.max_swap_share: 1.0 is outside 0.01-0.9"),
    ],
)
def test_impossible_lifecycle_settings_are_named_by_key_path(
    tmp_path: Path, toml: str, problem: str
) -> None:
    with pytest.raises(config.ConfigError) as caught:
        config.load(write(tmp_path, toml))
    assert any(problem in p for p in caught.value.problems), caught.value.problems


ONE_GPU = (
    '[groups.gpu0]\nmax_loaded = 2\nmemory_mib = 10240\n'
    'free_memory_command = ["nvidia-smi", "--query-gpu=memory.free"]\n'
    + slot("a", group="gpu0", memory_mib=4096, start="on_demand", idle_unload_s=0.5)
    + slot("b", group="gpu0", memory_mib=4096, start="on_demand", load_timeout_s=30)
    + slot("c", group="gpu0", memory_mib=2048)
    + slot("plain", command=False)
)


def test_a_one_gpu_config_loads_with_its_defaults(tmp_path: Path) -> None:
    loaded = config.load(write(tmp_path, ONE_GPU))
    a, b, c, plain = loaded.slots
    assert (a.on_demand, a.idle_unload_s, a.load_timeout_s) == (True, 0.5, 600.0)
    assert (b.on_demand, b.load_timeout_s) == (True, 30.0)
    assert (c.on_demand, c.start, c.idle_unload_s) == (False, "always", 0.0)
    assert (plain.on_demand, plain.group) == (False, None)
    assert loaded.groups["gpu0"] == config.GroupConfig(
        "gpu0", 2, 10240, ("nvidia-smi", "--query-gpu=memory.free")
    )
    # Turns priced by the measured swaps, at most a fifth of the time; no wait bound unless set.
    gpu0 = loaded.groups["gpu0"]
    assert (gpu0.policy, gpu0.max_swap_share, gpu0.max_wait_s) == ("batch", 0.2, None)
    assert gpu0.min_turn_loads == 3.0


def test_a_groups_policy_and_max_wait_s_load_and_check_config_names_a_bad_one(
    tmp_path: Path
) -> None:
    fifo = '[groups.gpu0]\nmax_loaded = 1\npolicy = "fifo"\nmax_wait_s = 2\n'
    loaded = config.load(write(tmp_path, fifo + slot("a", group="gpu0", start="on_demand")))
    assert (loaded.groups["gpu0"].policy, loaded.groups["gpu0"].max_wait_s) == ("fifo", 2.0)
    off = config.load(write(tmp_path, fifo + "min_turn_loads = 0\n"
                            + slot("a", group="gpu0", start="on_demand")))
    assert off.groups["gpu0"].min_turn_loads == 0.0
    share = config.load(write(tmp_path, fifo + "max_swap_share = 0.1\n"
                              + slot("a", group="gpu0", start="on_demand")))
    assert share.groups["gpu0"].max_swap_share == 0.1
    path = write(tmp_path, fifo.replace('"fifo"', '"batched"')
                 + slot("a", group="gpu0", start="on_demand"))
    result = hal0d_cli("check-config", "--config", str(path))
    assert result.returncode == 1
    assert "groups.gpu0.policy: 'batched' is not one of ('batch', 'fifo')" in result.stderr


def test_a_slot_larger_than_its_groups_budget_fails_check_config(tmp_path: Path) -> None:
    path = write(tmp_path, GPU + slot("a", group="gpu0", memory_mib=12000, start="on_demand"))
    result = hal0d_cli("check-config", "--config", str(path))
    assert result.returncode == 1
    assert "slots[0].memory_mib: 12000 MiB exceeds the budget of group 'gpu0'" in result.stderr


def test_print_config_shows_groups_and_lifecycle_keys_and_round_trips(tmp_path: Path) -> None:
    path = write(tmp_path, ONE_GPU)
    result = hal0d_cli("print-config", "--config", str(path))
    assert result.returncode == 0, result.stderr
    printed = tomllib.loads(result.stdout)
    assert printed["groups"]["gpu0"]["max_loaded"] == 2
    assert printed["slots"][0]["start"] == "on_demand"
    assert "idle_unload_s" not in printed["slots"][3]  # no command: the key cannot apply
    assert config.load(write(tmp_path, result.stdout)) == config.load(path)


def test_one_mistake_is_one_problem_naming_its_slot_not_a_cascade() -> None:
    """A typo in a slot of a group, or a command given as a string, is reported once, with the
    slot's name; the group that slot names is not 'named by no slot', and the keys that need a
    command are not refused for want of one."""
    group = '[groups.gpu0]\nmax_loaded = 1\n'
    alpha = 'name = "alpha"\nupstream = "http://127.0.0.1:9"\nmodels = ["m"]\n'
    typo = ('[[slots]]\nname = "beta"\nupstream = "http://127.0.0.1:10"\nmodels = ["n"]\n'
            'command = ["llama-server"]\nstart = "on_demand"\ngroup = "gpu0"\n'
            'idle_unlaod_s = 60\n')
    with pytest.raises(config.ConfigError) as caught:
        config.parse(tomllib.loads("[[slots]]\n" + alpha + typo + group))
    [problem] = caught.value.problems
    assert problem.startswith("slots[1].idle_unlaod_s: unknown key"), problem
    assert problem.endswith('(slot "beta")'), problem

    as_string = typo.replace('command = ["llama-server"]', 'command = "llama-server -m x.gguf"'
                             ).replace("idle_unlaod_s", "idle_unload_s")
    with pytest.raises(config.ConfigError) as caught:
        config.parse(tomllib.loads("[[slots]]\n" + alpha + as_string + group))
    [problem] = caught.value.problems
    assert problem.startswith("slots[1].command:") and '(slot "beta")' in problem, problem
