"""`make install DESTDIR=...` stages a tree that can be moved into place as it is: it names only
its final paths, it carries the starter config (no demo slot), and it does not tell the person
staging it to start a service that is not installed yet.

This runs the real Makefile target: a virtualenv on the system Python and a `pip install .` from
the package registry (about 30 s).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
INSTALL_PYTHON = Path("/usr/bin/python3")


def system_python_is_new_enough() -> bool:
    if not INSTALL_PYTHON.exists():
        return False
    check = subprocess.run(
        [str(INSTALL_PYTHON), "-c", "import sys; sys.exit(sys.version_info < (3, 11))"]
    )
    return check.returncode == 0


pytestmark = pytest.mark.skipif(
    not system_python_is_new_enough(), reason="make install needs /usr/bin/python3 >= 3.11"
)


def files_naming(root: Path, needle: bytes) -> list[str]:
    named = []
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink() and needle in path.read_bytes():
            named.append(str(path.relative_to(root)))
    return named


@pytest.fixture(scope="module")
def staged(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    stage = tmp_path_factory.mktemp("stage")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MAKE", "PIP_"))}
    done = subprocess.run(
        ["make", "--no-print-directory", "install", f"DESTDIR={stage}", "PREFIX=/usr/local",
         f"INSTALL_PYTHON={INSTALL_PYTHON}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return stage, done.stdout


def test_the_staged_tree_names_no_staging_path_and_no_source_folder(
    staged: tuple[Path, str],
) -> None:
    stage, _ = staged
    assert files_naming(stage, str(stage).encode()) == []
    assert files_naming(stage, str(REPO).encode()) == []
    assert not list(stage.rglob("direct_url.json"))
    compiled = next((stage / "usr/local/lib/hal0d/lib").rglob(
        "hal0d/cli/__pycache__/commands.*.pyc"))
    assert b"/usr/local/lib/hal0d/lib/" in compiled.read_bytes()


def test_the_staged_config_is_the_starter_not_the_demo(staged: tuple[Path, str]) -> None:
    stage, _ = staged
    config = stage / "etc/hal0d/hal0d.toml"
    assert config.read_bytes() == (REPO / "etc/hal0d.starter.toml").read_bytes()
    parsed = tomllib.loads(config.read_text())
    assert all("command" not in slot for slot in parsed["slots"])
    assert "stub" not in config.read_text()
    assert parsed["metrics"]["database"] == "/var/lib/hal0d/history.sqlite3"
    checked = subprocess.run(
        [sys.executable, "-m", "hal0d", "check-config", "--config", str(config)],
        capture_output=True, text=True,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_staging_does_not_say_to_start_the_service(staged: tuple[Path, str]) -> None:
    stage, output = staged
    assert "enable --now" not in output
    assert f"staged in {stage}" in output
    unit = (stage / "etc/systemd/system/hal0d.service").read_text()
    assert "ExecStart=/usr/local/bin/hal0d" in unit
    assert os.readlink(stage / "usr/local/bin/hal0d") == "/usr/local/lib/hal0d/bin/hal0d"
