"""Checks of a valid configuration against the machine it is about to run on.

config.parse answers "is this file well-formed"; these checks answer "will it work here": is there
anything to serve, do the slots' programs and the model files they name exist, are the
environment variables they name set, does llama-server leave each request enough context.

An error means hal0d would serve nothing: `check-config` and `serve` exit 1. A warning is a fact
of the environment that may still change before the service starts (a program installed later,
a variable the systemd unit sets with Environment=): `check-config` prints it and exits 0, and
`serve` logs it once at start as a `config.warning` event, in the environment it really runs in.
"""

from __future__ import annotations

import fnmatch
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from hal0d.config import Config, SlotConfig, answer_name, context_split, model_files
from hal0d.programs import resolve_program

# Below this many tokens per llama-server slot a warning says so: Codex's and Claude Code's
# first request (the system prompt and the tools) fills a few thousand on its own.
MIN_CONTEXT_PER_SLOT = 8192


@dataclass(frozen=True, slots=True)
class Finding:
    key: str  # the key path, as config.ConfigError names it: `slots[0].command`
    problem: str

    def __str__(self) -> str:
        return f"{self.key}: {self.problem}"


@dataclass(frozen=True, slots=True)
class Findings:
    errors: list[Finding] = field(default_factory=list)
    warnings: list[Finding] = field(default_factory=list)


def check(config: Config) -> Findings:
    findings = Findings()
    if not config.slots and not config.library:
        findings.errors.append(
            Finding("slots", "no [[slots]] table: hal0d would serve nothing")
        )
    elif not config.slots:
        # Models put in the sources later are found by a rescan (SIGHUP, hal0d models --rescan).
        findings.warnings.append(Finding("library", "no model found: hal0d serves none until a "
                                         "rescan finds some"))
    findings.warnings.extend(Finding("library", problem) for problem in config.library_problems)
    for index, slot in enumerate(config.slots):
        path = slot_path(slot, index)
        if slot.command:
            problem = program_problem(slot.command)
            if problem:
                findings.warnings.append(Finding(f"{path}.command", problem))
            findings.warnings.extend(Finding(f"{path}.command", problem)
                                     for problem in command_problems(slot.command))
            if (problem := answer_name_problem(slot)) is not None:
                findings.warnings.append(Finding(f"{path}.command", problem))
        if slot.api_key_env is not None:
            problem = api_key_env_problem(slot)
            if problem:
                findings.warnings.append(Finding(f"{path}.api_key_env", problem))
    findings.warnings.extend(quota_findings(config))
    if config.devices.devices_command is not None and (problem := program_problem(
            config.devices.devices_command, "no device's memory can be read")):
        findings.warnings.append(Finding("devices.devices_command", problem))
    return findings


def quota_findings(config: Config) -> list[Finding]:
    """A key's token quota below what one request may use on a model it may reach (the
    model's context: the prompt and the answer's max_tokens together): one request may cross
    the quota alone (it finishes; the next is refused until the quota resets)."""
    found: list[Finding] = []
    for index, key in enumerate(config.keys):
        contexts = [(context, slot.name) for slot in config.slots
                    if (context := slot_context(slot)) is not None
                    and (key.models is None or any(fnmatch.fnmatchcase(model, glob)
                                                   for model in slot.models
                                                   for glob in key.models))]
        if not contexts:
            continue
        context, slot_name = max(contexts)
        for per, quota in (("hour", key.tokens_per_hour), ("day", key.tokens_per_day)):
            if quota is not None and quota < context:
                found.append(Finding(
                    f"keys[{index}].tokens_per_{per}",
                    f"{quota} is below one request's max_tokens on slot {slot_name!r} (up to "
                    f"its context, {context} tokens): a single request may use the whole "
                    f"quota (it finishes; the key's next requests are refused until it resets)"))
    return found


def slot_context(slot: SlotConfig) -> int | None:
    """The tokens one request may use on `slot`, where its config says: its `context`, else
    llama-server's -c per request."""
    if slot.context is not None:
        return slot.context
    split = context_split(slot.command or ())
    return split.per_slot if split is not None else None


def slot_path(slot: SlotConfig, index: int | None = None) -> str:
    """How a finding names a slot: its place in the file, or the library model it is."""
    if slot.library is not None:
        return f'library model "{slot.library.names[0]}"'
    return f"slots[{index}]" if index is not None else f'slot "{slot.name}"'


def program_problem(command: tuple[str, ...],
                    consequence: str = "the slot's process cannot be started") -> str | None:
    """Why `command` could not be started here, looked up as hal0d looks it up
    (programs.resolve_program); `consequence`: what that costs, said after it."""
    program = resolve_program(command)[0]
    if "{" in program:
        return None  # a placeholder: what it stands for is known when the process starts
    if os.sep not in program:
        return (
            f"program {program!r} is not found beside {Path(sys.executable).parent} "
            f"(hal0d's Python) nor on PATH; {consequence}"
        )
    if not os.path.isfile(program):
        return f"{program!r} does not exist; {consequence}"
    if not os.access(program, os.X_OK):
        return f"{program!r} is not executable; {consequence}"
    return None


def command_problems(command: tuple[str, ...]) -> list[str]:
    """What the command line itself tells of a load that will fail or serve badly: a model
    file that is not there (config/slot_command.py reads the known servers' options), and
    llama-server's context split so thin between its slots that an agent's prompt overflows."""
    problems: list[str] = []
    for model in model_files(command):
        path = Path(model.path)
        if not path.exists():
            problems.append(f"model file {model.path!r} ({model.option}) does not exist"
                            + ("" if path.is_absolute() else " (a relative path is read from "
                               f"the folder hal0d runs in, here {Path.cwd()})")
                            + "; the slot's process cannot load it")
        elif not os.access(path, os.R_OK):
            problems.append(f"model file {model.path!r} ({model.option}) is not readable by "
                            "this user; the slot's process cannot load it")
    split = context_split(command)
    if split is not None and split.per_slot < MIN_CONTEXT_PER_SLOT and split.parallel == 1:
        problems.append(
            f"llama-server gives each request -c {split.context} tokens, below "
            f"{MIN_CONTEXT_PER_SLOT} (a coding agent's first prompt alone can be larger); raise "
            f"-c to {MIN_CONTEXT_PER_SLOT} or more")
    elif split is not None and split.per_slot < MIN_CONTEXT_PER_SLOT:
        problems.append(
            f"llama-server splits -c {split.context} between its --parallel {split.parallel} "
            f"slots: {split.per_slot} tokens per request, below {MIN_CONTEXT_PER_SLOT} (a coding "
            "agent's first prompt alone can be larger); raise -c to "
            f"{split.parallel * MIN_CONTEXT_PER_SLOT} or more, or lower --parallel")
    return problems


def answer_name_problem(slot: SlotConfig) -> str | None:
    """llama-server answers under its own name for the model, relayed to /v1 clients byte for
    byte (rewriting every answer would cost each request a parse). A name other than the
    slot's is what a client that checks `model` trips on; `--alias` makes the server answer
    under the slot's name."""
    answered = answer_name(slot.command or (), os.environ)
    if answered is None or answered in slot.models:
        return None
    return (f"llama-server answers \"model\": {answered!r}, not the name clients ask for "
            f"({slot.models[0]!r}); add \"--alias\", \"{','.join(slot.models)}\" to the command "
            "(with several names it answers under the first in sorted order)")


def api_key_env_problem(slot: SlotConfig) -> str | None:
    value = os.environ.get(str(slot.api_key_env))
    if value is None:
        return (
            f"the environment variable {slot.api_key_env} is not set; "
            "requests to this slot go without an API key"
        )
    if not value.strip():
        return (
            f"the environment variable {slot.api_key_env} is empty; "
            "requests to this slot go without an API key"
        )
    return None
