"""The command line (`hal0d` and `python -m hal0d`): commands.py parses and runs its commands,
daemon.py is their client of a running daemon's admin API (status, load, unload, requests)."""

from hal0d.cli.commands import main

__all__ = ["main"]
