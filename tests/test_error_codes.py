"""Every error_code hal0d records comes from one enum (hal0d.errors.ErrorCode), with the values
the history and /metrics have always shown."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from hal0d import errors
from hal0d.errors import ErrorCode, Hal0Error, stall_reason, stream_stall, upstream_status

ROOT = Path(__file__).resolve().parents[1]


def hal0_errors() -> list[type[Hal0Error]]:
    found, todo = [], [Hal0Error]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


def test_each_error_is_recorded_as_the_last_part_of_its_envelope_code() -> None:
    """The values the history held before the enum: `dispatch.upstream_unavailable` was
    recorded as `upstream_unavailable`, `request.invalid` as `invalid`."""
    for cls in hal0_errors():
        if cls is errors.UpstreamStatus:
            continue
        if cls is errors.ContextExceeded:
            # Its envelope code is OpenAI's own, which the openai SDK and Codex read; the
            # history's is hal0d's.
            assert (cls.code, cls.error_code) == ("context_length_exceeded", "context_exceeded")
            continue
        assert cls.error_code == cls.code.rsplit(".", 1)[-1], cls.__name__
        assert isinstance(cls.error_code, ErrorCode), cls.__name__
    status = errors.UpstreamStatus(503, "busy")
    assert status.error_code == status.code == "upstream_status_503"


def test_the_parametrised_codes_are_built_from_the_enum_prefix() -> None:
    assert upstream_status(429) == "upstream_status_429"
    assert stream_stall("idle") == "stream_stall_idle"
    assert stall_reason(stream_stall("unloaded")) == "unloaded"
    assert stall_reason(ErrorCode.CLIENT_STALLED) is None
    assert stall_reason(None) is None


def test_every_code_the_readme_lists_is_an_enum_value_or_built_from_one() -> None:
    text = (ROOT / "docs" / "operations.md").read_text()
    start = text.index("`error_code` says how a request ended badly")
    listed = re.findall(r"`([a-z_<>|]+)`", text[start:text.index("\n\n", start)])[1:]
    assert len(listed) >= 14, listed
    values = {code.value for code in ErrorCode}
    for code in listed:
        if code.startswith("stream_stall_"):
            assert all(stream_stall(r) for r in code.removeprefix("stream_stall_").split("|"))
            continue
        if code == "upstream_status_<code>":
            continue
        assert code in values, code


RECORDING_CALLS = ("fail", "TransformFailed", "Outcome")
# Translator.fail(message) takes the text of an error event, not a code.
NOT_RECORDING = ("translator",)


def literal_codes(path: Path, root: Path = ROOT) -> list[str]:
    """Where `path` records an error code written as a string: an argument of fail(),
    TransformFailed() or Outcome(), or an assignment to an `error_code` attribute."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        values: list[ast.expr] = []
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            receiver = ast.unparse(func.value) if isinstance(func, ast.Attribute) else ""
            if name in RECORDING_CALLS and not receiver.endswith(NOT_RECORDING):
                values = [*node.args[:1], *(k.value for k in node.keywords
                                             if k.arg == "error_code")]
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                elements = target.elts if isinstance(target, ast.Tuple) else [target]
                value = node.value
                for index, element in enumerate(elements):
                    if isinstance(element, ast.Attribute) and element.attr == "error_code":
                        if isinstance(value, ast.Tuple):
                            values.append(value.elts[index])
                        elif value is not None:
                            values.append(value)
        for value in values:
            if isinstance(value, ast.JoinedStr) or (
                isinstance(value, ast.Constant) and isinstance(value.value, str)
            ):
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    return sorted(found, key=lambda site: int(site.rpartition(":")[2]))


def test_no_module_records_an_error_code_as_a_free_string() -> None:
    paths = sorted((ROOT / "hal0d").rglob("*.py"))
    sites = [site for path in paths for site in literal_codes(path)]
    assert sites == []


def test_the_scan_finds_a_free_string(tmp_path: Path) -> None:
    """The scan above can fail: each way of writing a code as a string is found."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        'info.fail("client_stalled")\n'
        'raise TransformFailed(f"upstream_{kind}", b"")\n'
        'outcome.ok, outcome.error_code = False, "upstream_broken"\n'
        "info.fail(ErrorCode.CLIENT_STALLED)\n"
    )
    assert literal_codes(sample, tmp_path) == ["sample.py:1", "sample.py:2", "sample.py:3"]
