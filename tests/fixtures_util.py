"""Where the shared real-upstream captures live, for tests in a clone or a CI checkout.

shared/ sits beside the repository (CI copies it next to a fresh clone), never inside it.
"""

from __future__ import annotations

from pathlib import Path

SHARED = Path(__file__).resolve().parents[2] / "shared"


def fixture_path(name: str) -> Path:
    path = SHARED / "fixtures" / name
    if not path.is_file():
        raise FileNotFoundError(f"shared fixture {name!r} not found at {path}")
    return path
