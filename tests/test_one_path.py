"""The shape issue 12 gave the code, held by the code itself: every request reaches its upstream
through the one forward path, and aiohttp's client exceptions are sorted in one module."""

from __future__ import annotations

import ast
from pathlib import Path

import aiohttp

HAL0D = Path(__file__).resolve().parents[1] / "hal0d"


def modules() -> dict[str, ast.Module]:
    return {str(path.relative_to(HAL0D.parent)): ast.parse(path.read_text())
            for path in sorted(HAL0D.rglob("*.py"))}


def calls_to(tree: ast.Module, name: str) -> list[int]:
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call)
            and ((isinstance(node.func, ast.Name) and node.func.id == name)
                 or (isinstance(node.func, ast.Attribute) and node.func.attr == name))]


# The transport's exceptions: aiohttp's client errors (not the server's web.HTTPException).
CLIENT_ERRORS = frozenset(aiohttp.client_exceptions.__all__)


def aiohttp_errors_named(tree: ast.Module) -> list[int]:
    """Lines that name one of aiohttp's client exceptions (aiohttp.X, or X imported from
    aiohttp), in an `except` clause or anywhere else (a tuple of them to catch later)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "aiohttp":
            lines += [node.lineno for alias in node.names if alias.name in CLIENT_ERRORS]
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and node.value.id == "aiohttp" and node.attr in CLIENT_ERRORS):
            lines.append(node.lineno)
    return sorted(set(lines))


def test_only_the_forward_path_opens_an_upstream_request() -> None:
    callers = {name: lines for name, tree in modules().items()
               if (lines := calls_to(tree, "open_upstream"))}
    assert callers.keys() == {"hal0d/forward.py"}, callers


def test_only_the_upstream_module_names_aiohttps_client_exceptions() -> None:
    naming = {name: lines for name, tree in modules().items()
              if (lines := aiohttp_errors_named(tree))}
    assert set(naming) == {"hal0d/upstream.py"}, naming


def test_the_scans_find_what_they_look_for() -> None:
    """The two scans above can fail: each finds its target in a module written to have it."""
    tree = ast.parse(
        "import aiohttp\nfrom aiohttp import ClientError\n"
        "async def f():\n"
        "    try:\n        await open_upstream()\n    except aiohttp.ClientPayloadError:\n"
        "        pass\n"
        "    try:\n        pass\n    except (ClientError, OSError):\n        pass\n"
    )
    assert calls_to(tree, "open_upstream") == [5]
    assert aiohttp_errors_named(tree) == [2, 6]
