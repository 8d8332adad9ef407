"""`hal0d models`: what the config's [[library]] sources hold, a line a model, and whether the
running hal0d has it loaded; `--rescan` has the running hal0d look again first (as a SIGHUP
does); `--config` prints the [[slots]] tables hal0d makes of them, for a user who pins one by
hand (a [[slots]] table serving a model's name wins over the library's)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import tomli_w

from hal0d import config as configuration
from hal0d import library
from hal0d.library.view import library_view

MIB = 1024 * 1024


def add_models_command(commands: Any, default_config: str) -> None:
    models: argparse.ArgumentParser = commands.add_parser(
        "models", help="list the models the [[library]] sources hold")
    models.add_argument("--file", default=default_config, metavar="CONFIG",
                        help=f"the config file (default {default_config})")
    models.add_argument("--url", help="the running hal0d (default: from the config file)")
    what = models.add_mutually_exclusive_group()
    what.add_argument("--config", action="store_true",
                      help="print the [[slots]] tables made of the models instead")
    what.add_argument("--rescan", action="store_true",
                      help="have the running hal0d scan its sources again first")


def run_models(args: argparse.Namespace) -> int:
    from hal0d.cli import daemon

    try:
        config = configuration.load(args.file, find_models=library.find_models)
    except configuration.ConfigError as exc:
        for problem in exc.problems:
            print(problem, file=sys.stderr)
        return 1
    if args.config:
        sys.stdout.write(slot_tables(config))
        return 0
    running = daemon.locate(args.file, args.url, args.file)
    try:
        if args.rescan:
            view = daemon.call(running, "POST", "/api/library/rescan", timeout=None)
        else:
            view = daemon.call(running, "GET", "/api/library")
        note = None
    except daemon.ClientError as exc:
        if args.rescan:
            print(f"hal0d models: {exc}", file=sys.stderr)
            return 1
        view, note = library_view(config, None), f"({exc}: loaded or not is not known)"
    print(models_table(view), flush=True)
    for problem in view["problems"]:
        print(f"not served: {problem}", file=sys.stderr)
    if note:
        print(note, file=sys.stderr)
    return 0


def models_table(view: dict[str, Any]) -> str:
    if not view["models"]:
        sources = ", ".join(view["sources"]) or "no [[library]] table"
        return f"no model found in {sources}"
    rows = [("NAME", "SOURCE", "FILE", "SIZE", "QUANT", "CONTEXT", "MEMORY", "GROUP", "STATE")]
    for model in view["models"]:
        rows.append((
            ", ".join(model["names"]), model["source"], model["file"],
            f"{model['size_bytes'] / MIB:.0f} MiB", model["quantization"] or "-",
            f"{model['context']}" + (f"/{model['trained_context']}"
                                     if model["trained_context"] else ""),
            f"~{model['estimate_mib']} MiB", model["group"] or "-",
            model["state"] or "?"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)
                               ).rstrip() for row in rows)


def slot_tables(config: configuration.Config) -> str:
    tables = [dict(slot.library.table) for slot in config.slots if slot.library is not None]
    if not tables:
        return "# no model found by [[library]]\n"
    return ("# The [[slots]] tables hal0d makes of the models its [[library]] tables find.\n"
            "# Pasted into the config, a table is that model's own (it wins over the library's).\n"
            + tomli_w.dumps({"slots": tables}))
