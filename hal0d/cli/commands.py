"""The command line: serve | check-config | print-config | stub | status | load | unload |
requests | models, and --version. The operator's commands talk to a running daemon through
daemon.py."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hal0d import __version__, library, preflight
from hal0d import config as configuration
from hal0d.cli.models import add_models_command, run_models
from hal0d.config.ports import unused_port

if TYPE_CHECKING:
    from hal0d_stub.device_load import DeviceLoad

DEFAULT_CONFIG = "/etc/hal0d/hal0d.toml"


def whole_number(low: int, high: int, noun: str) -> Callable[[str], int]:
    """An argparse type: a whole number from low to high, else a one-line reason it is not."""

    def parse(text: str) -> int:
        try:
            number = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {noun}") from None
        if not low <= number <= high:
            raise argparse.ArgumentTypeError(f"{number} is outside {low}-{high}")
        return number

    return parse


port_number = whole_number(1, 65535, "port number")
count_of_rows = whole_number(1, 1000, "number")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hal0d", description="Local LLM dispatcher daemon.")
    parser.add_argument("--version", action="version", version=f"hal0d {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the daemon in the foreground")
    serve.add_argument("--config", default=DEFAULT_CONFIG, help=f"(default {DEFAULT_CONFIG})")
    serve.add_argument("--host", help="listen on this address instead of [server].host")
    serve.add_argument("--port", type=port_number,
                       help="listen on this port instead of [server].port")
    serve.add_argument("--ollama-port", type=whole_number(0, 65535, "port number"),
                       help="the Ollama listener on this port of [ollama].listen's host "
                       "instead (0: a free port, named in the server.started line)")

    check = commands.add_parser("check-config", help="validate a config file")
    check.add_argument("--config", default=DEFAULT_CONFIG, help=f"(default {DEFAULT_CONFIG})")

    show = commands.add_parser("print-config", help="print the effective config as TOML")
    source = show.add_mutually_exclusive_group()
    source.add_argument("--config", default=DEFAULT_CONFIG, help=f"(default {DEFAULT_CONFIG})")
    source.add_argument("--defaults", action="store_true",
                        help="print the built-in defaults, without reading any file")

    add_stub_command(commands)
    add_client_commands(commands)
    add_models_command(commands, DEFAULT_CONFIG)
    return parser


def add_stub_command(commands: Any) -> None:
    """`hal0d stub`: the stub upstream, with llama-server's server-slot options."""
    stub: argparse.ArgumentParser = commands.add_parser(
        "stub", help="run the stub OpenAI-compatible upstream")
    stub.add_argument("--host", default="127.0.0.1")
    stub.add_argument("--port", type=int, default=8091)
    stub.add_argument("--log", type=Path, help="append a line per request event to this file")
    stub.add_argument(
        "--delay", type=float, default=0.02, help="seconds between tokens (default 0.02)"
    )
    stub.add_argument("--startup-delay", type=float, default=0.0,
                      help="seconds before it listens, as a model loads (default 0)")
    stub.add_argument("--fail-start", metavar="MESSAGE",
                      help="after the startup delay, print MESSAGE and exit 1 instead of serving")
    stub.add_argument("--anthropic-native", action="store_true",
                      help="also serve the Anthropic Messages API (/v1/messages, count_tokens) "
                      "natively, as llama-server does")
    stub.add_argument("--chat-only", action="store_true",
                      help="serve no Responses API (/v1/responses answers 404), as "
                      "llama-cpp-python's server")
    stub.add_argument("--props", type=Path, metavar="JSON_FILE",
                      help="answer GET /props with this file, as llama-server describes "
                      "itself, its n_ctx the slots' own (without it /props answers 404)")
    add_server_slot_options(stub.add_argument_group(
        "server slots and their prompt cache, as llama-server's"))


def add_server_slot_options(slots: Any) -> None:
    """The stub's llama-server options: its model, names, server slots, their context and
    prompt cache, and their faults on demand."""
    from hal0d_stub.slots import ODD_ANSWERS  # the stub's own words, loaded only for its parser

    slots.add_argument("-m", "--model", metavar="FILE",
                       help="the model file, as llama-server's (the stub reads nothing from it)")
    slots.add_argument("-mm", "--mmproj", metavar="FILE",
                       help="a vision projector file, as llama-server's (nothing is read from it)")
    slots.add_argument("-a", "--alias", action="append", default=[], metavar="NAMES",
                       help="model names, comma-separated, as llama-server's: any name asked "
                       "is served, and answers carry the first in sorted order")
    slots.add_argument("-np", "--parallel", type=whole_number(1, 1024, "number of slots"),
                       default=1, help="number of server slots (default 1)")
    slots.add_argument("-c", "--ctx-size", type=whole_number(1, 1 << 24, "context size"),
                       help="context of all slots together, each slot's share the most a "
                       "prompt and its answer may hold (default 4096, or with --props the "
                       "context the file names)")
    slots.add_argument("--max-model-len", type=whole_number(1, 1 << 24, "context size"),
                       metavar="N", help="check each request's prompt and max_tokens against "
                       "N as vLLM does (its 400 and words), in place of the slots' context; "
                       "/v1/models lists max_model_len")
    slots.add_argument("-sps", "--slot-prompt-similarity", type=float, default=0.1,
                       metavar="SIMILARITY", help="how much of a prompt a slot's cache must "
                       "hold for the prompt to go there (default 0.10, 0 = by id_slot and LRU)")
    slots.add_argument("--slot-save-path", type=Path, metavar="PATH",
                       help="directory of the slot files of POST /slots/{id}?action=save|restore "
                       "(without it those are refused)")
    slots.add_argument("--prefill-ms-per-token", type=float, default=0.0, metavar="MS",
                       help="milliseconds it reads each uncached prompt token (default 0)")
    slots.add_argument("--slot-save-fail", action="store_true",
                       help="every save fails (500), as a failed write does")
    slots.add_argument("--slot-save-delay", type=float, default=0.0, metavar="SECONDS",
                       help="every save hangs this long before it is done (default 0)")
    slots.add_argument("--slot-restore-fail", action="store_true",
                       help="every restore fails (400), as an unreadable file does")
    slots.add_argument("--slot-restore-delay", type=float, default=0.0, metavar="SECONDS",
                       help="every restore hangs this long before it is done (default 0)")
    for action in ("save", "restore"):
        slots.add_argument(f"--slot-odd-{action}", choices=ODD_ANSWERS, default=None,
                           help=f"every {action} answers 200 with this instead of its object: "
                           "a JSON list, a JSON string, or counts that are no numbers")
    add_simulated_device_options(slots)


def add_simulated_device_options(slots: Any) -> None:
    """The stub's load on the simulated GPU box (hal0d_stub/device_load.py), among its server
    slots' options as llama-server's --tensor-split is among its own."""
    from hal0d_stub.device_load import parse_tensor_split  # as ODD_ANSWERS: only for the parser

    slots.add_argument("--device-state", type=Path, metavar="FILE",
                       help="load onto the simulated GPU box in FILE (python -m "
                       "hal0d_stub.devices), on the devices CUDA_VISIBLE_DEVICES names (else "
                       "HIP_VISIBLE_DEVICES; else device 0): the stub takes --footprint-mib "
                       "there before it listens, or fails with llama-server's out-of-memory "
                       "lines and exits 1; it gives the memory back as it exits")
    slots.add_argument("--footprint-mib", type=whole_number(0, 1 << 30, "number of MiB"),
                       metavar="MIB", help="the memory the model takes on the simulated box "
                       "(with --device-state)")

    def tensor_split(text: str) -> tuple[float, ...]:
        try:
            return parse_tensor_split(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    slots.add_argument("-ts", "--tensor-split", type=tensor_split, default=(),
                       metavar="N0,N1,...", help="the footprint's proportions on each visible "
                       "device, as llama-server's (default: even)")


def simulated_device_load(args: argparse.Namespace) -> DeviceLoad | None:
    """The stub's footprint on the simulated box (a hal0d_stub DeviceLoad), or None without
    --device-state; ValueError when the options do not go together."""
    if args.device_state is None:
        if args.footprint_mib is not None or args.tensor_split:
            raise ValueError("--footprint-mib and --tensor-split need --device-state")
        return None
    if args.footprint_mib is None:
        raise ValueError("--device-state needs --footprint-mib")
    from hal0d_stub.device_load import NO_MODEL_PATH, DeviceLoad

    return DeviceLoad(args.device_state, args.footprint_mib, args.tensor_split,
                      args.model or NO_MODEL_PATH)


def add_client_commands(commands: Any) -> None:
    """The commands that talk to a running daemon, each with --config or --url."""

    def client(name: str, help_text: str) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = commands.add_parser(name, help=help_text)
        where = parser.add_mutually_exclusive_group()
        where.add_argument("--config", help="find the daemon (host, port, API key) from this "
                           f"config (default {DEFAULT_CONFIG}; built-in defaults when missing)")
        where.add_argument("--url", help="the daemon's URL, e.g. http://127.0.0.1:8080 "
                           "(the key from HAL0D_API_KEY)")
        return parser

    status = client("status", "show every slot: state, load, traffic, speed")
    status.add_argument("--watch", action="store_true",
                        help="redraw as events arrive (from /api/events) until Ctrl-C")
    load = client("load", "load an on-demand slot; returns once it is ready")
    load.add_argument("name")
    unload = client("unload", "unload an on-demand slot (drains its requests first)")
    unload.add_argument("name")
    unload.add_argument("--force", action="store_true",
                        help="end its in-flight streams and fail its queued requests")
    history = client("requests", "show the newest finished requests, newest first")
    history.add_argument("-n", type=count_of_rows, default=20, dest="count",
                         help="how many (1-1000, default 20)")
    history.add_argument("--key", metavar="NAME", help="only those of the [[keys]] entry NAME")


def run_client(args: argparse.Namespace) -> int:
    from hal0d.cli import daemon

    try:
        running = daemon.locate(args.config, args.url, DEFAULT_CONFIG)
        if args.command == "status" and args.watch:
            # Ctrl-C ends it even when started from a shell that ignores SIGINT (a background job).
            signal.signal(signal.SIGINT, signal.default_int_handler)
            try:
                daemon.watch(running)
            except KeyboardInterrupt:
                return 0
        elif args.command == "status":
            print(daemon.status(running))
        elif args.command == "load":
            print(daemon.load(running, args.name))
        elif args.command == "unload":
            print(daemon.unload(running, args.name, args.force))
        else:
            print(daemon.requests(running, args.count, args.key))
    except daemon.ClientError as exc:
        print(f"hal0d {args.command}: {exc}", file=sys.stderr)
        return 1
    return 0


def load_or_report(path: str) -> configuration.Config | None:
    try:
        return configuration.load(path, find_models=library.find_models)
    except configuration.ConfigError as exc:
        for problem in exc.problems:
            print(problem, file=sys.stderr)
        return None


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def check_config(path: str) -> int:
    config = load_or_report(path)
    if config is None:
        return 1
    findings = preflight.check(config)
    findings.warnings.extend(device_findings(config))
    for error in findings.errors:
        print(error, file=sys.stderr)
    for warning in findings.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if findings.errors:
        return 1
    found = sum(1 for slot in config.slots if slot.library is not None)
    summary = f"{path}: ok ({plural(len(config.slots), 'slot')}" + (
        f", {found} of them models found by [[library]])" if config.library else ")")
    if findings.warnings:
        summary += f" with {plural(len(findings.warnings), 'warning')}"
    print(summary)
    return 0


def device_findings(config: configuration.Config) -> list[preflight.Finding]:
    """The devices read once (check-config only: serve reads them as it runs): a warning for
    each model that can never fit on its devices, or for devices that cannot be read."""
    from hal0d.devices import fit  # here: a read of NVML is not what every command pays for

    reading = asyncio.run(fit.read_once(config))
    if reading is None:
        return []
    if reading.error is not None:
        return [preflight.Finding("devices", f"cannot be read now ({reading.error}): no "
                                  "model's size was checked against them")]
    return [preflight.Finding(preflight.slot_path(config.slots[index], index), problem)
            for index, problem in fit.never_fits(config, reading)]


def serve(args: argparse.Namespace) -> int:
    config = load_or_report(args.config)
    if config is None:
        return 1
    findings = preflight.check(config)
    if findings.errors:
        for error in findings.errors:
            print(error, file=sys.stderr)
        return 1
    overrides: dict[str, Any] = {
        key: value for key, value in (("host", args.host), ("port", args.port))
        if value is not None
    }
    if args.ollama_port is not None:
        listen = ollama_listen(config, args.ollama_port, avoid=args.port or config.server.port)
        if listen is None:
            print(f"{args.config}: --ollama-port needs [ollama].listen in the config",
                  file=sys.stderr)
            return 2
        overrides["ollama_listen"] = listen
    from hal0d.server import serve as run_server

    return run_server(config, Path(args.config), server_overrides=overrides,
                      warnings=findings.warnings)


def ollama_listen(config: configuration.Config, port: int, avoid: int) -> str | None:
    """[ollama].listen with its port replaced (0: a free one, picked once, here, and not
    `avoid`, the main port, which is not bound yet); None when the config has no Ollama
    listener."""
    address = config.ollama.address
    if address is None:
        return None
    if port == 0:
        port = unused_port()
        while port == avoid:
            port = unused_port()
    host = f"[{address[0]}]" if ":" in address[0] else address[0]
    return f"{host}:{port}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "stub":
        from hal0d_stub.app import run_stub
        from hal0d_stub.context import ctx_size
        from hal0d_stub.slots import SlotOptions

        props = json.loads(args.props.read_text()) if args.props else None
        slot_options = SlotOptions(
            parallel=args.parallel, ctx_size=ctx_size(args.ctx_size, props, args.parallel),
            similarity=args.slot_prompt_similarity, save_path=args.slot_save_path,
            prefill_ms_per_token=args.prefill_ms_per_token, save_fail=args.slot_save_fail,
            save_delay=args.slot_save_delay, restore_fail=args.slot_restore_fail,
            restore_delay=args.slot_restore_delay, odd_save=args.slot_odd_save,
            odd_restore=args.slot_odd_restore)
        try:
            device_load = simulated_device_load(args)
        except ValueError as exc:
            print(f"hal0d stub: {exc}", file=sys.stderr)
            return 2
        return run_stub(args.host, args.port, args.log, args.delay,
                        startup_delay=args.startup_delay, fail_start=args.fail_start,
                        anthropic_native=args.anthropic_native, chat_only=args.chat_only,
                        slot_options=slot_options, props=props,
                        max_model_len=args.max_model_len,
                        aliases=tuple(name.strip() for names in args.alias
                                      for name in names.split(",") if name.strip()),
                        device_load=device_load)
    if args.command == "print-config":
        config = configuration.Config() if args.defaults else load_or_report(args.config)
        if config is None:
            return 1
        sys.stdout.write(configuration.to_toml(config))
        return 0
    if args.command == "check-config":
        return check_config(args.config)
    if args.command in ("status", "load", "unload", "requests"):
        return run_client(args)
    if args.command == "models":
        return run_models(args)
    return serve(args)
