"""Durations written as Go writes them ("90s", "5m", "1h30m", "300ms"): Ollama's `keep_alive`
takes them, and so does every `*_s` key of the config, so the one reading is here, in the base
layer both import from.
"""

from __future__ import annotations

import re

# Go's time.ParseDuration units, in seconds.
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0,
          "h": 3600.0}
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
# How a config's problem shows the form it expects.
DURATION_EXAMPLES = '"90s", "5m", "1h30m"'


def go_duration(text: str) -> float | None:
    """Go's time.ParseDuration ("1h30m", "300ms", "-1m", "0") in seconds; None if invalid."""
    text = text.strip()
    sign = -1.0 if text.startswith("-") else 1.0
    rest = text[1:] if text[:1] in ("+", "-") else text
    if rest == "0":
        return 0.0
    total, at = 0.0, 0
    while at < len(rest):
        match = _DURATION_PART.match(rest, at)
        if match is None:
            return None
        total += float(match.group(1)) * _UNITS[match.group(2)]
        at = match.end()
    return sign * total if rest else None
