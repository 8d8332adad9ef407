"""The operator's client of a running hal0d: `hal0d status [--watch]`, `load`, `unload`,
`requests`, over the admin API (/api/slots, /api/slots/metrics, /api/events, /api/requests).

It finds the daemon from a config file (its [server] host and port, and a key from `api_keys`,
`api_keys_file` or [[keys]]) or from a URL, with HAL0D_API_KEY as the key when set. It speaks
plain HTTP with the standard library, so the commands start fast and need nothing the daemon
does not. Every
failure the operator can meet (the daemon is not running, it refuses the key, a slot it does not
know) is a ClientError with a one-line message.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import os
import queue
import socket
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

from hal0d import config as configuration
from hal0d.protocol import sse

KEY_VARIABLE = "HAL0D_API_KEY"
TIMEOUT_S = 30.0
# The feed sends a heartbeat every 15 s: three missed ones mean the daemon is gone.
WATCH_TIMEOUT_S = 45.0
METRICS_EVERY_S = 1.0  # --watch asks /api/slots/metrics at most this often
RECONNECT_S = 1.0  # --watch asks for the feed again this often while hal0d is away
REDRAW_S = 1.0  # --watch redraws at least this often, so its ages count up between events
CLEAR = "\x1b[H\x1b[2J"
READ_BYTES = 65536  # the most of the feed one read takes
Frame = tuple[str, dict[str, Any]]  # one event of the feed: its name and its data
# The addresses that mean "every interface" when listened on; a client reaches them on loopback.
_ANY = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}


class ClientError(Exception):
    """Why a command could not do its work, in one line for the operator."""


@dataclasses.dataclass(frozen=True)
class Daemon:
    url: str  # without a trailing slash
    key: str | None


def locate(config_path: str | None, url: str | None, default_config: str) -> Daemon:
    """The daemon named by --url, else by --config, else by the default config (or, when that
    file does not exist, the built-in defaults: 127.0.0.1:8080)."""
    key = os.environ.get(KEY_VARIABLE) or None
    if url is not None:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ClientError(f"--url {url!r} is not an http:// or https:// URL")
        return Daemon(url.rstrip("/"), key)
    path = config_path or default_config
    if config_path is None and not Path(path).exists():
        config = configuration.Config()
    else:
        try:
            config = configuration.load(path)
        except configuration.ConfigError as exc:
            raise ClientError(f"cannot use {path}: {'; '.join(exc.problems)}") from None
    server = config.server
    host = _ANY.get(server.host, server.host)
    if ":" in host:
        host = f"[{host}]"
    if key is None:
        key = config_key(config)
    return Daemon(f"http://{host}:{server.port}", key)


def config_key(config: configuration.Config) -> str | None:
    """The key the commands present from the config file: an api_keys key (every scope), else
    the [[keys]] entry with the most scopes (status reads, load and unload administer)."""
    server = config.server
    if server.accepted_keys:
        return server.api_keys[0] if server.api_keys else sorted(server.accepted_keys)[0]
    if config.keys:
        return max(config.keys, key=lambda entry: len(entry.scopes)).secret
    return None


class Refused(ClientError):
    """hal0d answered, and refused (a key, a 403, a 404): asking again will not help."""


def _open(daemon: Daemon, method: str, path: str, timeout: float | None
          ) -> http.client.HTTPResponse:
    request = urllib.request.Request(daemon.url + path, method=method)
    if daemon.key is not None:
        request.add_header("Authorization", f"Bearer {daemon.key}")
    try:
        response: http.client.HTTPResponse = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as exc:
        raise Refused(_refusal(daemon, exc)) from None
    except urllib.error.URLError as exc:
        reason = exc.reason
        if isinstance(reason, ConnectionRefusedError):
            raise ClientError(f"hal0d is not running at {daemon.url} (connection refused)"
                              ) from None
        raise ClientError(f"cannot reach hal0d at {daemon.url}: {reason}") from None
    except (TimeoutError, ConnectionError, http.client.HTTPException) as exc:
        raise ClientError(f"no answer from hal0d at {daemon.url}: {exc or 'timed out'}"
                          ) from None
    return response


def _refusal(daemon: Daemon, exc: urllib.error.HTTPError) -> str:
    try:
        message = json.loads(exc.read())["error"]["message"]
    except (ValueError, KeyError, TypeError, OSError):
        message = exc.reason
    if exc.code == 401:
        hint = "set HAL0D_API_KEY, or [[keys]] or [server].api_keys in the --config file"
        if daemon.key is not None:
            return f"hal0d at {daemon.url} refused the API key: {message}"
        return f"hal0d at {daemon.url} needs an API key: {hint}"
    return f"{message} (HTTP {exc.code})"


def call(daemon: Daemon, method: str, path: str, timeout: float | None = TIMEOUT_S) -> Any:
    with _open(daemon, method, path, timeout) as response:
        try:
            return json.loads(response.read())
        except (ValueError, OSError) as exc:
            raise ClientError(f"hal0d at {daemon.url} answered {path} with no JSON: {exc}"
                              ) from None


# -- the commands ------------------------------------------------------------------------------

def load(daemon: Daemon, name: str) -> str:
    # A load may take as long as the slot's load_timeout_s: no client-side bound of our own.
    answer = call(daemon, "POST", f"/api/slots/{urllib.parse.quote(name)}/load", timeout=None)
    return f"{answer['slot']}: {answer['state']} (waited {answer['waited_ms'] / 1000:.1f} s)"


def unload(daemon: Daemon, name: str, force: bool) -> str:
    path = f"/api/slots/{urllib.parse.quote(name)}/unload" + ("?force=true" if force else "")
    answer = call(daemon, "POST", path, timeout=None)  # it drains the requests in flight
    return f"{answer['slot']}: {answer['state']}"


def _count(value: int | None) -> str:
    return "-" if value is None else str(value)


def requests(daemon: Daemon, count: int, key: str | None = None) -> str:
    query = urllib.parse.urlencode({"limit": count, **({"key": key} if key else {})})
    rows = call(daemon, "GET", f"/api/requests?{query}")["requests"]
    header = ("TIME", "REQUEST", "KEY", "SLOT", "MODEL", "STATUS", "QUEUE_MS", "LOAD_MS",
              "TTFT_MS", "TOTAL_MS", "TOKENS")
    lines = [header]
    for row in rows:
        tokens = "-"
        if row.get("prompt_tokens") is not None or row.get("completion_tokens") is not None:
            # An unknown count is "-", not 0: a stream without usage has no prompt count.
            tokens = f"{_count(row.get('prompt_tokens'))}/{_count(row.get('completion_tokens'))}"
        status = str(row["status"]) + ("" if row["ok"] else f" {row.get('error_code') or ''}")
        lines.append((
            time.strftime("%H:%M:%S", time.localtime(row["ts"])), row["request_id"],
            row.get("key") or "-", row.get("slot") or "-", row.get("model") or "-", status.strip(),
            _ms(row.get("queue_ms")), _ms(row.get("load_ms")), _ms(row.get("ttft_ms")),
            _ms(row.get("total_ms")), tokens,
        ))
    return _table(lines)


def status(daemon: Daemon) -> str:
    views = call(daemon, "GET", "/api/slots")["slots"]
    return Board(views, metrics(daemon)).render()


def metrics(daemon: Daemon) -> dict[str, dict[str, Any]]:
    return {entry["name"]: entry for entry in call(daemon, "GET", "/api/slots/metrics")["slots"]}


def watch(daemon: Daemon, out: TextIO = sys.stdout, *, retry_s: float = RECONNECT_S) -> None:
    """Redraws the status table as events arrive, until the operator presses Ctrl-C
    (KeyboardInterrupt, the caller's to catch). Once it has shown hal0d, a hal0d that goes away
    (it restarts, it stops, it goes quiet) gets the notice the page shows, and the feed is asked
    for again every `retry_s`. A hal0d that never answered, or a refusal (a missing or wrong
    key), ends it with a ClientError."""
    seen = False
    while True:
        try:
            lost = _watch_once(daemon, out)
            seen = True
        except Refused:
            raise
        except ClientError as exc:
            if not seen:
                raise
            lost = str(exc)
        out.write(f"\nConnection to hal0d lost: reconnecting... ({lost})\n")
        out.flush()
        time.sleep(retry_s)


def _watch_once(daemon: Daemon, out: TextIO) -> str:
    """One connection to the feed, drawn until it ends; returns why it ended. A ClientError
    when the feed cannot be opened at all. The feed is read in a thread of its own, so the
    table is also redrawn every REDRAW_S between events: its ages (idle 5s, probing 12s) count
    up as the page's do, instead of standing still until the next event."""
    board = Board([], {})
    with _open(daemon, "GET", "/api/events", WATCH_TIMEOUT_S) as response:
        frames: queue.Queue[Frame | BaseException | None] = queue.Queue()
        reader = threading.Thread(target=_read_frames, args=(response, frames), daemon=True)
        reader.start()
        try:
            return _draw_frames(daemon, out, board, frames)
        finally:
            if reader.is_alive():
                # Leaving while the reader waits on the feed (Ctrl-C): closing the response
                # would wait for the reader's read, until the next heartbeat, up to 15 s.
                _wake_reader(response)


def _wake_reader(response: http.client.HTTPResponse) -> None:
    """Ends the read the reader thread is blocked in: the feed's socket shut down, through a
    duplicate of its descriptor (http.client keeps the socket itself to itself)."""
    with contextlib.suppress(OSError, ValueError), socket.fromfd(
            response.fileno(), socket.AF_INET, socket.SOCK_STREAM) as duplicate:
        duplicate.shutdown(socket.SHUT_RDWR)


def _draw_frames(daemon: Daemon, out: TextIO, board: Board,
                 frames: queue.Queue[Frame | BaseException | None]) -> str:
    """The feed's frames drawn as they come, and at least every REDRAW_S; why the feed ended."""
    metrics_at = 0.0
    while True:
        try:
            item = frames.get(timeout=REDRAW_S)
        except queue.Empty:
            if board.views:
                _draw(out, daemon, board)
            continue
        if item is None:
            break
        if isinstance(item, TimeoutError):
            return f"hal0d at {daemon.url} went quiet (no heartbeat in {WATCH_TIMEOUT_S:g} s)"
        if isinstance(item, (ConnectionError, http.client.HTTPException)):
            return f"lost hal0d at {daemon.url}: {item}"
        if isinstance(item, BaseException):
            raise item
        name, data = item
        board.apply(name, data)
        now = time.monotonic()
        if name in ("hello", "request") and now - metrics_at >= METRICS_EVERY_S:
            try:
                board.metrics = metrics(daemon)
            except ClientError as exc:  # its metrics, asked as hal0d went away
                return str(exc)
            metrics_at = now
        _draw(out, daemon, board)
    return f"hal0d at {daemon.url} ended the event stream (restarting?)"



def _read_frames(response: http.client.HTTPResponse,
                 frames: queue.Queue[Frame | BaseException | None]) -> None:
    """The feed's frames onto `frames`, then None at its end, or what ended it."""
    try:
        for item in sse_events(response):
            frames.put(item)
    except BaseException as exc:  # handed to the drawing thread, which decides
        frames.put(exc)
        return
    frames.put(None)


def _draw(out: TextIO, daemon: Daemon, board: Board) -> None:
    out.write(CLEAR + f"hal0d at {daemon.url}  (Ctrl-C to quit)\n\n" + board.render() + "\n")
    if board.last:
        out.write(f"\nlast: {board.last}\n")
    out.flush()


def sse_events(response: http.client.HTTPResponse) -> Iterator[Frame]:
    """(event name, parsed data) per named event of the feed, decoded as the relay decodes an
    upstream (protocol.sse: lines end at CR, LF or CRLF). Read as it arrives, not by line: a
    line that never ends in LF would hold `readline` until the feed ends."""
    decoder = sse.Decoder()
    while chunk := response.read1(READ_BYTES):
        for event in decoder.feed(chunk):
            if event.event:
                yield event.event, json.loads(event.data) if event.data else {}


class Board:
    """The status table, kept up to date from the slot views and the events."""

    def __init__(self, views: list[dict[str, Any]], slot_metrics: dict[str, dict[str, Any]]
                 ) -> None:
        self.views: dict[str, dict[str, Any]] = {}
        self.seen: dict[str, float] = {}  # when each view was taken (its ages grow from there)
        # Per slot loading: its load's phase, the seconds it had lasted, and when that was told.
        self.loading: dict[str, tuple[str, float, float]] = {}
        self.metrics = slot_metrics
        self.last = ""
        for view in views:
            self._take(view)

    def _take(self, view: dict[str, Any]) -> None:
        name, now = view["name"], time.monotonic()
        self.views[name] = view
        self.seen[name] = now
        load = view.get("load")
        if load:
            self.loading[name] = (load["phase"], load["elapsed_s"] + time.time() - load["ts"], now)
        else:
            self.loading.pop(name, None)

    def apply(self, name: str, data: dict[str, Any]) -> None:
        if name == "hello":
            self.views.clear()
            for view in data["slots"]:
                self._take(view)
        elif name == "slot":
            self._take(data["view"])
            self.last = f"{data['slot']}: {data['old']} -> {data['new']}" + (
                f" ({data['reason']})" if data.get("reason") else "")
        elif name == "counts":  # in flight or queued changed, with no change of state
            if (view := self.views.get(data["slot"])) is not None:
                view["in_flight"], view["queued"] = data["in_flight"], data["queued"]
        elif name == "load":
            if data["phase"] in ("ready", "failed"):
                self.loading.pop(data["slot"], None)
            else:
                self.loading[data["slot"]] = (data["phase"], data["elapsed_s"],
                                              time.monotonic())
            if data["phase"] == "failed":
                self.last = f"{data['slot']}: load failed: {data.get('reason')}"
        elif name == "unload":
            self.last = f"{data['slot']}: unloaded ({data['reason']})"
        elif name == "request":
            self.last = (f"request {data['request_id']} {data.get('model') or '-'} -> "
                         f"{data['status']} in {_ms(data.get('total_ms'))} ms")
        elif name == "dropped":
            self.last = f"{data['dropped']} events dropped (this terminal fell behind)"

    def render(self) -> str:
        lines = [("SLOT", "STATE", "MODELS", "IN_FLIGHT", "QUEUED", "LOADED/IDLE", "MEMORY_MIB",
                  "TOK/S", "TTFT_P50_MS")]
        for name, view in self.views.items():
            state = view["state"]
            if name in self.loading:
                phase, elapsed_s, told = self.loading[name]
                state += f" ({phase} {_duration(elapsed_s + time.monotonic() - told)})"
            entry = self.metrics.get(name, {})
            tokens_per_s = entry.get("tokens_per_s")
            ttft = (entry.get("ttft_ms") or {}).get("p50")
            lines.append((
                name, state, ",".join(view.get("models", [])), str(view["in_flight"]),
                str(view["queued"]), self._age(name, view),
                "-" if view.get("memory_mib") is None else str(view["memory_mib"]),
                "-" if tokens_per_s is None else f"{tokens_per_s:.1f}", _ms(ttft),
            ))
        # Why a slot is in its state (an error, a failed load), as the page shows it.
        reasons = [f"{name}: {view['reason']}" for name, view in self.views.items()
                   if view.get("reason")]
        return _table(lines) + ("\n\n" + "\n".join(reasons) if reasons else "")

    def _age(self, name: str, view: dict[str, Any]) -> str:
        since = time.monotonic() - self.seen[name]
        if view.get("idle_for_s") is not None:
            return f"idle {_duration(view['idle_for_s'] + since)}"
        if view.get("loaded_for_s") is not None:
            return f"loaded {_duration(view['loaded_for_s'] + since)}"
        return "-"


def _duration(seconds: float) -> str:
    whole = int(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _table(rows: Sequence[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)
                               ).rstrip() for row in rows)
