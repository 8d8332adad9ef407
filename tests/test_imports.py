"""The layers of hal0d's house, held by its imports: a request walks down through them and no
module imports one above its own layer, nor one that imports it back (a circle).

A circle of imports makes the order modules load in decide whether the daemon starts, and an
arrow up means a lower layer knows a higher one (the metrics knowing the lifecycle manager, the
request's record knowing the relay). The graph is read from the source (ast), not by importing,
so the test sees every `import` at any depth, and imports under `if TYPE_CHECKING:` count as
well: a circle or an arrow up that only the type checker walks is still a lower layer that names
a higher one.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hal0d"

# From the top down: a module may import its own layer's modules and the layers below it. Each
# entry names a module, or with ".*" a package and every module in it.
LAYERS: tuple[tuple[str, frozenset[str]], ...] = (
    ("the command line", frozenset({"hal0d.__main__", "hal0d.cli.*"})),
    ("the server: start, signals, reload, drain", frozenset({"hal0d.server", "hal0d.preflight"})),
    ("the app: routes, middleware, wiring", frozenset({"hal0d.app", "hal0d.contexts"})),
    ("the handlers, one per surface", frozenset({"hal0d.handlers.*"})),
    ("the app's shared objects", frozenset({"hal0d.appkeys"})),
    ("the forward path", frozenset({"hal0d.forward.*"})),
    ("observability", frozenset({"hal0d.observability.*"})),
    ("the lifecycle", frozenset({"hal0d.lifecycle.*"})),
    # Below the lifecycle: placement by measured memory will read them from there.
    ("the devices", frozenset({"hal0d.devices.*"})),
    ("the transport", frozenset({"hal0d.transport.*"})),
    ("the surfaces' pure translations", frozenset({"hal0d.openai.*", "hal0d.anthropic.*",
                                                  "hal0d.ollama.*"})),
    ("the protocol", frozenset({"hal0d.protocol.*"})),
    ("the base", frozenset({"hal0d", "hal0d.config.*", "hal0d.errors", "hal0d.logs", "hal0d.keys",
                           "hal0d.systemd", "hal0d.front.*", "hal0d.programs", "hal0d.routing",
                           "hal0d.response_owners", "hal0d.conversations",
                           "hal0d.library.*", "hal0d.shares.*"})),
)


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, name: str, modules: set[str]) -> set[str]:
    """The hal0d modules `path` imports: `from hal0d.x import y` counts as hal0d.x.y when y is
    a module, else as hal0d.x; relative imports are resolved against the module's package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                       for alias in node.names]
        else:
            continue
        found.update(target for target in targets if target in modules)
    found.discard(name)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    paths = {module_name(path, root): path for path in sorted(root.rglob("*.py"))}
    modules = set(paths)
    return {name: imports_of(path, name, modules) for name, path in paths.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as the path of modules that closes it (first == last), or None."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" once fully explored
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                return [*path[path.index(target):], target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_hal0d_has_no_import_cycle() -> None:
    graph = import_graph(PACKAGE)
    assert len(graph) > 40, "the walk found too few modules to mean anything"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_a_cycle_is_found_and_named(tmp_path: Path) -> None:
    """The walk can fail: a package with a circle through a TYPE_CHECKING import, a relative
    import and a submodule named in `from package import module` is reported as that circle."""
    root = tmp_path / "pkg"
    (root / "sub").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "sub" / "__init__.py").write_text("")
    (root / "a.py").write_text("from pkg.sub import b\n")
    (root / "sub" / "b.py").write_text("from . import c\n")
    (root / "sub" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n"
    )
    (root / "d.py").write_text("import pkg.a\n")
    assert find_cycle(import_graph(root)) == ["pkg.a", "pkg.sub.b", "pkg.sub.c", "pkg.a"]
    (root / "sub" / "c.py").write_text("")
    assert find_cycle(import_graph(root)) is None


def layer_of(module: str, layers: tuple[tuple[str, frozenset[str]], ...]) -> int | None:
    """The index of the layer that names `module`, or a package (".*") holding it."""
    parts = module.split(".")
    names = {module} | {".".join(parts[:end]) + ".*" for end in range(1, len(parts) + 1)}
    for index, (_, members) in enumerate(layers):
        if names & members:
            return index
    return None


def arrows_up(graph: dict[str, set[str]], layers: tuple[tuple[str, frozenset[str]], ...]
              ) -> list[str]:
    """Every import from a module to one in a higher layer, and every module in no layer."""
    found = []
    for module in sorted(graph):
        own = layer_of(module, layers)
        if own is None:
            found.append(f"{module} is in no layer")
            continue
        for target in sorted(graph[module]):
            theirs = layer_of(target, layers)
            if theirs is not None and theirs < own:
                found.append(f"{module} ({layers[own][0]}) imports {target} ({layers[theirs][0]})")
    return found


def test_no_module_imports_a_higher_layer_and_every_module_has_one() -> None:
    graph = import_graph(PACKAGE)
    assert arrows_up(graph, LAYERS) == []


def test_an_arrow_up_and_a_module_without_a_layer_are_found(tmp_path: Path) -> None:
    """The walk can fail: a lower module importing a higher one, under TYPE_CHECKING, and a
    module no layer names are both reported."""
    root = tmp_path / "pkg"
    (root / "low").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "low" / "__init__.py").write_text("")
    (root / "top.py").write_text("from pkg.low import base\n")
    (root / "low" / "base.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import top\n"
    )
    (root / "stray.py").write_text("")
    layers = (("top", frozenset({"pkg.top"})), ("low", frozenset({"pkg", "pkg.low.*"})))
    assert arrows_up(import_graph(root), layers) == [
        "pkg.low.base (low) imports pkg.top (top)",
        "pkg.stray is in no layer",
    ]
    (root / "low" / "base.py").write_text("")
    (root / "stray.py").unlink()
    assert arrows_up(import_graph(root), layers) == []


# -- the tests' own imports: no test module imports another --------------------------------------

REPOSITORY = PACKAGE.parent
TEST_TREES = (REPOSITORY / "tests", REPOSITORY / "tests_real")


def imported_names(path: Path, root: Path) -> set[str]:
    """The dotted names `path` imports, relative imports resolved against its folder below
    `root`; `from x import y` counts both x and x.y (y may be a module)."""
    package = list(path.parent.relative_to(root).parts)
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            anchor = package[: len(package) - node.level + 1] if node.level else []
            base = ".".join([*anchor, *([node.module] if node.module else [])])
            found.update(f"{base}.{alias.name}".lstrip(".") for alias in node.names)
            if base:
                found.add(base)
    return found


def module_file(name: str, importer: Path, root: Path) -> Path | None:
    """The file `name` is, from `root` or from the importer's own folder (pytest puts a test's
    folder on the path, as tests_real's `from realserver import ...` relies on); None for a
    module that is neither (the standard library's, a package's)."""
    parts = name.split(".")
    for base in (root, importer.parent):
        for candidate in (base.joinpath(*parts).with_suffix(".py"),
                          base.joinpath(*parts, "__init__.py")):
            if candidate.is_file():
                return candidate
    return None


def is_test_module(path: Path) -> bool:
    return path.name.startswith("test_") or path.name == "conftest.py"


def imports_of_test_modules(trees: tuple[Path, ...], root: Path) -> list[str]:
    """Every import, in any module of `trees`, of a test module (test_*.py) or a conftest."""
    found = []
    for tree in trees:
        for path in sorted(tree.rglob("*.py")):
            for name in sorted(imported_names(path, root)):
                target = module_file(name, path, root)
                if target is not None and target != path and is_test_module(target):
                    found.append(f"{path.relative_to(root)} imports {target.relative_to(root)}")
    return sorted(set(found))


def test_no_test_module_imports_another_nor_a_conftest() -> None:
    """What two test modules share lives in tests/harness/; fixtures are asked for by name, not
    imported. A test module imported by another runs its own tests' imports (and a module-level
    skip) in the importer, and a fixture imported by name is a second copy of it."""
    assert (REPOSITORY / "tests" / "harness").is_dir()
    assert imports_of_test_modules(TEST_TREES, REPOSITORY) == [], (
        "move what these share into tests/harness/")


def test_an_import_of_a_test_module_is_found_however_it_is_written(tmp_path: Path) -> None:
    """The walk can fail: `from tests.test_x import`, `import tests.test_x`, `from tests import
    test_x` inside a function, a relative `from . import test_x`, an import of a conftest, and a
    bare `from test_x import` beside the importer are each reported; imports of the harness, of
    a helper module and of the standard library are not."""
    tests, real = tmp_path / "tests", tmp_path / "tests_real"
    (tests / "harness").mkdir(parents=True)
    real.mkdir()
    for empty in (tests / "__init__.py", tests / "harness" / "__init__.py",
                  tests / "harness" / "poll.py", tests / "helper.py", tests / "test_b.py",
                  real / "realserver.py", real / "test_real_b.py"):
        empty.write_text("")
    (tests / "conftest.py").write_text("import tests.test_b\nfrom tests.harness import poll\n")
    (tests / "test_a.py").write_text(
        "import ast\nfrom tests.test_b import shared\nfrom tests import helper\n\n\n"
        "def test_it():\n    from tests import test_b\n")
    (tests / "harness" / "daemons.py").write_text("from .. import conftest\n")
    (tests / "test_c.py").write_text("from . import test_b\nfrom tests.harness.poll import x\n")
    (real / "test_real_a.py").write_text("from realserver import x\nfrom test_real_b import y\n")
    assert imports_of_test_modules((tests, real), tmp_path) == [
        "tests/conftest.py imports tests/test_b.py",
        "tests/harness/daemons.py imports tests/conftest.py",
        "tests/test_a.py imports tests/test_b.py",
        "tests/test_c.py imports tests/test_b.py",
        "tests_real/test_real_a.py imports tests_real/test_real_b.py",
    ]
    for path in (tests / "conftest.py", tests / "test_a.py", tests / "harness" / "daemons.py",
                 tests / "test_c.py", real / "test_real_a.py"):
        path.write_text("from tests.harness import poll\nfrom realserver import x\n")
    assert imports_of_test_modules((tests, real), tmp_path) == []
