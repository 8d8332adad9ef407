"""The shape the code was given, held by the code itself: every request reaches its upstream
through the one forward path, every call to an upstream goes through the one client over the one
session, and aiohttp's client exceptions are sorted in one module."""

from __future__ import annotations

import ast
from pathlib import Path

import aiohttp

HAL0D = Path(__file__).resolve().parents[1] / "hal0d"


def modules() -> dict[str, ast.Module]:
    return {str(path.relative_to(HAL0D.parent)): ast.parse(path.read_text())
            for path in sorted(HAL0D.rglob("*.py"))}


def calls_to(tree: ast.Module, owner: str, method: str) -> list[int]:
    """Lines that call `<owner>.<method>(...)`, the owner a plain name or an attribute."""
    lines = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == method):
            continue
        value = node.func.value
        if (isinstance(value, ast.Name) and value.id == owner) or (
                isinstance(value, ast.Attribute) and value.attr == owner):
            lines.append(node.lineno)
    return lines


def names(tree: ast.Module, name: str) -> list[int]:
    """Lines that name `name`, as a plain name, an attribute or an import."""
    lines = []
    for node in ast.walk(tree):
        if ((isinstance(node, ast.Name) and node.id == name)
                or (isinstance(node, ast.Attribute) and node.attr == name)
                or (isinstance(node, ast.ImportFrom)
                    and any(alias.name == name for alias in node.names))):
            lines.append(node.lineno)
    return lines


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
               if (lines := calls_to(tree, "upstreams", "open"))}
    assert callers.keys() == {"hal0d/forward/attempt.py"}, callers  # Forward._opening


def test_only_the_upstream_client_holds_a_client_session() -> None:
    """The probe, the token count and the Anthropic-mode probe ask through UpstreamClient.ask,
    the forward path through UpstreamClient.open: no other module has a session to call."""
    holders = {name: lines for name, tree in modules().items()
               if (lines := names(tree, "ClientSession") + names(tree, "session"))}
    assert holders.keys() == {"hal0d/transport/upstream.py"}, holders


def test_only_the_failures_module_names_aiohttps_client_exceptions() -> None:
    naming = {name: lines for name, tree in modules().items()
              if (lines := aiohttp_errors_named(tree))}
    assert set(naming) == {"hal0d/transport/failures.py"}, naming


def test_the_scans_find_what_they_look_for() -> None:
    """The two scans above can fail: each finds its target in a module written to have it."""
    tree = ast.parse(
        "import aiohttp\nfrom aiohttp import ClientError\n"
        "async def f():\n"
        "    try:\n        await self.upstreams.open()\n    except aiohttp.ClientPayloadError:\n"
        "        pass\n"
        "    try:\n        pass\n    except (ClientError, OSError):\n        pass\n"
    )
    assert calls_to(tree, "upstreams", "open") == [5]
    assert names(ast.parse("from aiohttp import ClientSession\nx.session.get()\n"),
                 "ClientSession") == [1]
    assert names(ast.parse("x.session.get()\n"), "session") == [1]
    assert aiohttp_errors_named(tree) == [2, 6]


# What the forward path keeps to itself: an upstream's response, and the steps of an exchange.
UPSTREAM_NAMES = ("ClientResponse", "read_whole", "relay", "_open", "open")


def test_no_handler_touches_an_upstream_response() -> None:
    """A handler builds an exchange and hands it to the forward path: none names aiohttp's
    ClientResponse, nor opens, reads or relays an upstream itself."""
    touching = {name: lines for name, tree in modules().items()
                if name.startswith("hal0d/handlers/")
                and (lines := sorted({line for word in UPSTREAM_NAMES
                                      for line in names(tree, word)}))}
    assert touching == {}, touching
    tree = ast.parse("import aiohttp\ndef f(r: aiohttp.ClientResponse):\n    fwd.open()\n")
    assert sorted({line for word in UPSTREAM_NAMES for line in names(tree, word)}) == [2, 3]


def test_the_translating_transforms_fill_in_one_skeleton() -> None:
    """The Anthropic, Ollama and Responses translators are the one skeleton's subclasses: the
    decoder, the feed loop, the failure mapping and the ending are written once."""
    from hal0d.anthropic.transform import AnthropicTransform
    from hal0d.ollama.transform import OllamaTransform
    from hal0d.openai.responses_bridge import BridgeTransform
    from hal0d.protocol.translating import Translating

    for transform in (AnthropicTransform, OllamaTransform, BridgeTransform):
        assert issubclass(transform, Translating), transform
        assert "feed" not in vars(transform) and "end" not in vars(transform), transform


def test_one_sse_reader_splits_the_lines_of_every_stream_hal0d_reads() -> None:
    """The feed reader of the command line and the metrics tap read SSE with protocol/sse.py;
    no other module that reads `data:` lines splits a stream's lines itself (a process's log
    output, which names no `data:`, is split where it is read)."""
    def reads_sse(tree: ast.Module) -> bool:
        return any(isinstance(node, ast.Constant) and isinstance(node.value, str | bytes)
                   and node.value[:5] in ("data:", b"data:") for node in ast.walk(tree))

    splitting = {name: lines for name, tree in modules().items()
                 if name != "hal0d/protocol/sse.py" and reads_sse(tree)
                 and (lines := line_splits(tree))}
    assert splitting == {}, splitting
    old_tap = "for line in chunk.split(b'\\n'):\n    if line.startswith(b'data:'): pass\n"
    old_client = "for raw in iter(response.readline, b''):\n    raw.startswith(b'data:')\n"
    assert line_splits(ast.parse(old_tap)) == [1] and line_splits(ast.parse(old_client)) == [1]


def line_splits(tree: ast.AST) -> list[int]:
    """Lines that split a stream at LF themselves: `.split(b"\\n")` and the like, or a
    `readline` (which ends a line at LF only)."""
    return sorted({node.lineno for node in ast.walk(tree)
                   if (isinstance(node, ast.Attribute) and node.attr == "readline")
                   or (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                       and node.func.attr in ("split", "splitlines")
                       and any(isinstance(arg, ast.Constant)
                               and arg.value in (b"\n", "\n", b"\r\n") for arg in node.args))})
