"""The demo and test upstream: an OpenAI-compatible stub server (`hal0d stub`), apart from the
daemon's own package."""
