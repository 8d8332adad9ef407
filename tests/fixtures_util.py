"""Where the real-upstream captures live: tests/fixtures/, inside the repository, so a fresh clone
runs its tests with nothing beside it (tests/fixtures/README.md says how they were captured)."""

from __future__ import annotations

from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def fixture_path(name: str) -> Path:
    path = FIXTURES / name
    if not path.is_file():
        raise FileNotFoundError(f"fixture {name!r} not found at {path}")
    return path
