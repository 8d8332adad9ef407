"""The command line: serve | check-config | print-config | stub."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hal0d import config as configuration

DEFAULT_CONFIG = "/etc/hal0d/hal0d.toml"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hal0d", description="Local LLM dispatcher daemon.")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the daemon in the foreground")
    serve.add_argument("--config", default=DEFAULT_CONFIG, help=f"(default {DEFAULT_CONFIG})")

    check = commands.add_parser("check-config", help="validate a config file")
    check.add_argument("--config", default=DEFAULT_CONFIG)

    show = commands.add_parser("print-config", help="print the effective config as TOML")
    show.add_argument("--config", help="a config file (default: built-in defaults only)")

    stub = commands.add_parser("stub", help="run the stub OpenAI-compatible upstream")
    stub.add_argument("--host", default="127.0.0.1")
    stub.add_argument("--port", type=int, default=8091)
    stub.add_argument("--log", type=Path, help="append a line per request event to this file")
    stub.add_argument(
        "--delay", type=float, default=0.02, help="seconds between tokens (default 0.02)"
    )
    return parser


def load_or_report(path: str) -> configuration.Config | None:
    try:
        return configuration.load(path)
    except configuration.ConfigError as exc:
        for problem in exc.problems:
            print(problem, file=sys.stderr)
        return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "stub":
        from hal0d.stub import run_stub

        run_stub(args.host, args.port, args.log, args.delay)
        return 0
    if args.command == "print-config":
        config = load_or_report(args.config) if args.config else configuration.Config()
        if config is None:
            return 1
        sys.stdout.write(configuration.to_toml(config))
        return 0
    config = load_or_report(args.config)
    if config is None:
        return 1
    if args.command == "check-config":
        print(f"{args.config}: ok ({len(config.slots)} slots)")
        return 0
    from hal0d.server import serve

    return serve(config, Path(args.config))
