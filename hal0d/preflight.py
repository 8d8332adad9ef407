"""Checks of a valid configuration against the machine it is about to run on.

config.parse answers "is this file well-formed"; these checks answer "will it work here": is there
anything to serve, do the slots' programs exist, are the environment variables they name set.

An error means hal0d would serve nothing: `check-config` and `serve` exit 1. A warning is a fact
of the environment that may still change before the service starts (a program installed later,
a variable the systemd unit sets with Environment=): `check-config` prints it and exits 0, and
`serve` logs it once at start as a `config.warning` event, in the environment it really runs in.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from hal0d.config import Config, SlotConfig
from hal0d.lifecycle.process import resolve_program


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
    if not config.slots:
        findings.errors.append(
            Finding("slots", "no [[slots]] table: hal0d would serve nothing")
        )
    for index, slot in enumerate(config.slots):
        path = f"slots[{index}]"
        if slot.command:
            problem = program_problem(slot.command)
            if problem:
                findings.warnings.append(Finding(f"{path}.command", problem))
        if slot.api_key_env is not None:
            problem = api_key_env_problem(slot)
            if problem:
                findings.warnings.append(Finding(f"{path}.api_key_env", problem))
    return findings


def program_problem(command: tuple[str, ...]) -> str | None:
    """Why the lifecycle manager could not start `command` here, looked up as it looks it up."""
    program = resolve_program(command)[0]
    if os.sep not in program:
        return (
            f"program {program!r} is not found beside {Path(sys.executable).parent} "
            "(hal0d's Python) nor on PATH; the slot's process cannot be started"
        )
    if not os.path.isfile(program):
        return f"{program!r} does not exist; the slot's process cannot be started"
    if not os.access(program, os.X_OK):
        return f"{program!r} is not executable; the slot's process cannot be started"
    return None


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
