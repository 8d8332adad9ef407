"""No function in hal0d is longer than MAX_LINES unless its def line says why (`# long: why`):
a long function hides its steps, and a reader should find them named. No module of ours (the
daemon, the stub, the bench, the tests, the page's scripts) is longer than MAX_MODULE_LINES."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hal0d"
MAX_LINES = 60
REASON = "# long: "


def long_functions(path: Path, root: Path) -> list[str]:
    """`file:line name (N lines)` for each function over MAX_LINES without a reason on the line
    its `def` is on (its decorators and docstring count toward its length)."""
    lines = path.read_text().splitlines()
    found = []
    for node in ast.walk(ast.parse("\n".join(lines))):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        length = (node.end_lineno or node.lineno) - start + 1
        if length > MAX_LINES and REASON not in lines[node.lineno - 1]:
            found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_no_function_is_long_without_a_reason() -> None:
    found = [hit for path in sorted(PACKAGE.rglob("*.py")) for hit in long_functions(path, PACKAGE)]
    assert found == []


def test_a_long_function_is_found_unless_its_def_line_says_why(tmp_path: Path) -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_LINES))
    sample = tmp_path / "sample.py"
    sample.write_text(f"def short():\n    pass\n\n\nasync def long():\n{body}")
    assert long_functions(sample, tmp_path) == [f"sample.py:5 long ({MAX_LINES + 1} lines)"]
    sample.write_text(f"async def long():  # long: a table of cases\n{body}")
    assert long_functions(sample, tmp_path) == []


MAX_MODULE_LINES = 500  # past this a module holds more than one reader can keep in mind
PROJECT = PACKAGE.parent
# Every module of ours: the daemon, the stub, the bench, the tests, and the page's scripts.
MODULE_TREES = ("hal0d", "hal0d_stub", "bench", "tests", "tests_real")


def modules(root: Path) -> list[Path]:
    found = [path for tree in MODULE_TREES for path in (root / tree).rglob("*.py")]
    return sorted(found + list((root / "hal0d" / "static").glob("*.js")))


def long_modules(root: Path) -> dict[str, int]:
    return {str(path.relative_to(root)): count for path in modules(root)
            if (count := len(path.read_text().splitlines())) > MAX_MODULE_LINES}


def test_no_module_is_longer_than_a_reader_can_hold() -> None:
    assert long_modules(PROJECT) == {}


def test_a_long_module_is_found_in_any_of_our_trees_and_a_page_script_too(tmp_path: Path) -> None:
    for tree in (*MODULE_TREES, "hal0d/static"):
        (tmp_path / tree).mkdir(parents=True, exist_ok=True)
    (tmp_path / "bench" / "long.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    (tmp_path / "hal0d" / "static" / "long.js").write_text("let x;\n" * (MAX_MODULE_LINES + 1))
    (tmp_path / "tests" / "short.py").write_text("x = 1\n" * MAX_MODULE_LINES)
    assert long_modules(tmp_path) == {"bench/long.py": MAX_MODULE_LINES + 1,
                                      "hal0d/static/long.js": MAX_MODULE_LINES + 1}
