"""A slot's `capabilities`: what its models can do, as Ollama's clients ask (/api/show).

An app reads them to decide what to offer: `llm-ollama` registers a model that can embed as an
embedding model and refuses `think` for one that cannot think, and caches what it read by the
model's digest. What use shows (a model seen reasoning once) comes too late for that cache, so
they are declared, or read from the upstream where it says (ollama/capabilities.py):

    capabilities = ["thinking", "tools"]                  every model of the slot
    capabilities = { qwen3 = ["thinking", "tools"],
                     nomic-embed = ["embedding"] }        per model (the others: undeclared)

The names are Ollama's (types/model/capability.go). `completion` goes without saying for every
model that is not declared as embedding alone.
"""

from __future__ import annotations

from typing import Any, Final

# Ollama's capability names, in the order its /api/show lists them.
CAPABILITIES: Final = ("completion", "tools", "insert", "vision", "embedding", "thinking",
                       "audio", "image")
# Per model of the slot: what its `capabilities` declare, in CAPABILITIES' order.
Declared = tuple[tuple[str, tuple[str, ...]], ...]


def check_capabilities(value: Any, models: tuple[str, ...], where: str,
                       problems: list[str]) -> Declared | None:
    """The slot's declaration, per model; None (with a problem for each fault) when it is
    not one."""
    before = len(problems)
    if isinstance(value, list):
        names = _names(value, where, problems)
        declared = tuple((model, names) for model in models)
    elif isinstance(value, dict):
        declared = tuple((str(model), _names(names, f"{where}.{model}", problems))
                         for model, names in value.items())
        for model, _ in declared:
            if model not in models:
                problems.append(f"{where}.{model}: not a model of this slot (its models: "
                                f"{', '.join(models)})")
    else:
        problems.append(f"{where}: {value!r} is not a list of capabilities nor a table of "
                        "them per model")
        return None
    return declared if len(problems) == before else None


def _names(value: Any, where: str, problems: list[str]) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        problems.append(f"{where}: must be a non-empty list of capabilities (any of "
                        f"{', '.join(CAPABILITIES)})")
        return ()
    unknown = [name for name in value if name not in CAPABILITIES]
    if unknown:
        problems.append(f"{where}: {', '.join(map(repr, unknown))} is not a capability (any "
                        f"of {', '.join(CAPABILITIES)})")
    return tuple(name for name in CAPABILITIES if name in value)
