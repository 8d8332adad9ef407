"""What a slot's command line says without running it: the model files the known model servers
are told to load, and how llama-server splits its context between its server slots.

check-config warns from these (preflight.py), before a load finds out the hard way. Only the
servers whose options are known here are read; any other program's `-m` means what that program
says it means, and nothing is read from it:

    llama-server                        -m/--model, -md/--model-draft, -mm/--mmproj FILE;
                                        -c/--ctx-size N split between -np/--parallel N slots
                                        (unless -kvu/--kv-unified: then every slot has it all;
                                        one slot, the default, has it all too);
                                        -a/--alias NAMES: what its answers call the model
    vllm serve MODEL                    MODEL or --model, when written as a path (./x, /x):
                                        any other is a Hugging Face name
    python -m llama_cpp.server          --model FILE
    python -m vllm.entrypoints.openai.api_server    --model, as vllm serve's

An argument that still holds a placeholder (`{...}`) is left alone: what it stands for is only
known when the process starts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePath
from typing import Final

LLAMA_SERVER: Final = "llama-server"
VLLM: Final = "vllm"
LLAMA_CPP_PYTHON: Final = "llama-cpp-python"
# `python -m MODULE`: the model servers run that way.
PYTHON_MODULES: Final = {"llama_cpp.server": LLAMA_CPP_PYTHON,
                         "vllm.entrypoints.openai.api_server": VLLM}
# The options that name a file to load, by server.
MODEL_OPTIONS: Final = {
    LLAMA_SERVER: ("-m", "--model", "-md", "--model-draft", "-mm", "--mmproj"),
    VLLM: ("--model",),
    LLAMA_CPP_PYTHON: ("--model",),
}
CONTEXT_OPTIONS: Final = ("-c", "--ctx-size")
ALIAS_OPTIONS: Final = ("-a", "--alias")
# llama-server reads its aliases from here too, when the command names none.
ALIAS_ENV: Final = "LLAMA_ARG_ALIAS"
PARALLEL_OPTIONS: Final = ("-np", "--parallel")
UNIFIED_OPTIONS: Final = ("-kvu", "--kv-unified")


@dataclass(frozen=True, slots=True)
class ModelFile:
    option: str  # as written: "-m", "--model", or "MODEL" for vllm serve's positional
    path: str


@dataclass(frozen=True, slots=True)
class ContextSplit:
    """llama-server's `-c` shared by its `--parallel` slots: each request gets `per_slot`."""

    context: int
    parallel: int

    @property
    def per_slot(self) -> int:
        return self.context // self.parallel


def server_of(command: Sequence[str]) -> tuple[str | None, list[str]]:
    """The known model server `command` runs (None for any other program) and its own
    arguments (after `serve`, or after `-m MODULE` for a Python one)."""
    name = PurePath(command[0]).name if command else ""
    args = list(command[1:])
    if name == LLAMA_SERVER:
        return LLAMA_SERVER, args
    if name == VLLM and args[:1] == ["serve"]:
        return VLLM, args[1:]
    if name.startswith("python") and "-m" in args:
        at = args.index("-m")
        module = args[at + 1] if at + 1 < len(args) else ""
        return PYTHON_MODULES.get(module), args[at + 2:]
    return None, args


def option_values(args: Sequence[str], names: Sequence[str]) -> list[tuple[str, str]]:
    """(option, value) for each of `names` in `args`, written `-m FILE` or `--model=FILE`."""
    found: list[tuple[str, str]] = []
    for index, arg in enumerate(args):
        option, equals, value = arg.partition("=")
        if option in names and equals:
            found.append((option, value))
        elif arg in names and index + 1 < len(args):
            found.append((arg, args[index + 1]))
    return found


def model_files(command: Sequence[str]) -> list[ModelFile]:
    """The files (or, for vLLM, folders) a known model server is told to load; for vLLM only
    a model written as a path."""
    server, args = server_of(command)
    if server is None:
        return []
    named = [ModelFile(option, value) for option, value in option_values(
        args, MODEL_OPTIONS[server])]
    if server == VLLM and command[1:2] == ["serve"] and args and not args[0].startswith("-"):
        named.append(ModelFile("MODEL", args[0]))
    if server == VLLM:
        named = [model for model in named if model.path.startswith(("/", "./", "../"))]
    return [model for model in named if "{" not in model.path and model.path]


def answer_name(command: Sequence[str], environ: Mapping[str, str]) -> str | None:
    """The name llama-server's answers carry in `"model"`: the first of its `--alias` names in
    sorted order (it keeps them in a sorted set and answers under the first), else its model
    file's path as written. None for another server, or when a placeholder stands in for it."""
    server, args = server_of(command)
    if server != LLAMA_SERVER:
        return None
    # Every --alias adds its names (comma-separated) to the set.
    written = [value for _, value in option_values(args, ALIAS_OPTIONS)]
    texts = written or [environ.get(ALIAS_ENV, "")]
    aliases = sorted(name.strip() for text in texts for name in text.split(",") if name.strip())
    if aliases:
        return None if "{" in aliases[0] else aliases[0]
    models = option_values(args, ("-m", "--model"))
    return models[-1][1] if models and "{" not in models[-1][1] else None


def context_split(command: Sequence[str]) -> ContextSplit | None:
    """What llama-server gives each request of its context, when the command sets it (the
    context from the model's own, `-c 0`, is not known here): `-c` split between its
    `--parallel` slots, or all of it with one slot (`--parallel 1`, or not given: a request at
    a time then has the whole context) or with `--kv-unified`."""
    server, args = server_of(command)
    if server != LLAMA_SERVER:
        return None
    context = _last_number(option_values(args, CONTEXT_OPTIONS))
    parallel = _last_number(option_values(args, PARALLEL_OPTIONS)) or 1
    if not context:
        return None
    if any(arg in UNIFIED_OPTIONS for arg in args):
        parallel = 1
    return ContextSplit(context, parallel)


def _last_number(values: list[tuple[str, str]]) -> int | None:
    """The option's value as the server reads it (the last one given wins); None when it is
    not given or no whole number."""
    if not values:
        return None
    text = values[-1][1]
    return int(text) if text.isdigit() else None
