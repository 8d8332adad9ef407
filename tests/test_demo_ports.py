"""The demo beside other programs: its stub's port is one hal0d picks free (`{free_port}` in
etc/hal0d.toml), so `make run PORT=X` serves with the old fixed port 8091 taken; `make run
PORT=X` moves the demo's Ollama listener off 11435 too, so two demos (or one beside a program on
11435) serve side by side; and a program on the port a slot's process is told to use never
makes that slot ready (nor answers for it)."""

from __future__ import annotations

import errno
import json
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

from tests.demo import (
    DEMO_STUB_LOG,
    READY_WITHIN_S,
    REPO,
    running_demo,
    slot_views,
    slots_ready,
    stop,
)
from tests.harness.ports import free_port

OLD_STUB_PORT = 8091
ERROR_WITHIN_S = 15.0


class Squatter(ThreadingHTTPServer):
    """Another program: answers every GET and POST as a healthy OpenAI server would, and counts
    the requests it got."""

    daemon_threads = True
    requests_seen = 0


class SquatterHandler(BaseHTTPRequestHandler):
    server: Squatter

    def answer(self) -> None:
        self.server.requests_seen += 1
        body = json.dumps({"data": [], "squatter": True}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = answer
    do_POST = answer

    def log_message(self, *_: object) -> None:
        pass


@contextmanager
def squatting(port: int) -> Iterator[Squatter | None]:
    """A foreign server on 127.0.0.1:`port`; None when some other program holds it already
    (it is taken either way, which is all the demo test needs)."""
    try:
        server = Squatter(("127.0.0.1", port), SquatterHandler)
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        yield None
        return
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def port_taken(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def chat(port: int) -> tuple[int, dict[str, object]]:
    body = json.dumps({"model": "chat", "messages": [{"role": "user", "content": "hi"}]})
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions", data=body.encode(),
        headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_make_run_serves_the_demo_with_port_8091_taken_by_another_program(tmp_path: Path) -> None:
    with squatting(OLD_STUB_PORT) as squatter:
        assert port_taken(OLD_STUB_PORT)
        with running_demo(tmp_path) as demo:
            [view] = slot_views(demo.port) or []
            stub_port = urlsplit(view["upstream"]).port
            assert stub_port not in (None, OLD_STUB_PORT, demo.port), view
            status, answer = chat(demo.port)
            assert status == 200 and "squatter" not in answer, answer
            assert any('"model": "chat"' in line or "chat" in line for line in demo.stub_lines())
        if squatter is not None:
            assert squatter.requests_seen == 0


def test_a_program_on_the_demo_stubs_port_never_makes_the_demo_slot_ready(
    tmp_path: Path,
) -> None:
    """The stub pinned to a port a foreign server holds: the load fails naming the port, the
    slot is never ready, and no request (no probe either) reaches the other program."""
    port = free_port()
    with squatting(port) as squatter:
        assert squatter is not None
        with running_demo(tmp_path, stub_port=port, wait_ready=False) as demo:
            states: list[str] = []
            deadline = time.monotonic() + ERROR_WITHIN_S
            view: dict[str, object] = {}
            while time.monotonic() < deadline:
                [view] = slot_views(demo.port) or [{"state": "unknown"}]
                states.append(str(view["state"]))
                if view["state"] == "error":
                    break
                time.sleep(0.05)
            assert view.get("state") == "error", (states, demo.diagnostics())
            assert f"127.0.0.1:{port} is already in use" in str(view["reason"]), view
            status, answer = chat(demo.port)
            assert status == 503 and "squatter" not in answer, answer
            assert "ready" not in states, states
            assert not demo.stub_lines()
        assert squatter.requests_seen == 0


def test_a_free_port_stays_the_slots_own_across_a_reload(tmp_path: Path) -> None:
    """A reload reads `{free_port}` again: the unchanged slot keeps its port and its process."""
    with running_demo(tmp_path) as demo:
        [before] = slot_views(demo.port) or []
        demo.process.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while "config.reloaded" not in demo.output.read_text():
            assert time.monotonic() < deadline, demo.diagnostics()
            time.sleep(0.05)
        [after] = slot_views(demo.port) or []
        assert after["upstream"] == before["upstream"] and after["state"] == "ready", after
        output = demo.output.read_text()
        assert output.count("slot.load_started") == 1, demo.diagnostics()


DEMO_OLLAMA_PORT = 11435


def make_run_argv(port: int, config: Path) -> list[str]:
    """The command `make run PORT=port` runs, as make prints it, on `config` (a copy of
    etc/hal0d.toml, so its history and stub log stay in the test's folder)."""
    printed = subprocess.run(
        ["make", "--no-print-directory", "-n", "run", f"PORT={port}", f"VENV={sys.prefix}"],
        cwd=REPO, capture_output=True, text=True, check=True).stdout
    [line] = [line for line in printed.splitlines() if " serve " in line]
    argv = shlex.split(line)
    argv[argv.index("etc/hal0d.toml")] = str(config)
    return argv


def ollama_address(output: Path) -> str | None:
    """The Ollama listener's address the server.started line names."""
    found = re.search(r"server\.started.*?\bollama['\"]?[=:]\s*['\"]?([\w.:\[\]]+)",
                      output.read_text())
    return found.group(1) if found else None


@contextmanager
def make_run(tmp: Path) -> Iterator[tuple[int, Path, subprocess.Popen[bytes]]]:
    """`make run PORT=...` in front of the demo configuration, its Ollama listener as the demo
    has it; yields once its slot is ready."""
    tmp.mkdir()
    port, config, output = free_port(), tmp / "hal0d.toml", tmp / "hal0d.out"
    text = (REPO / "etc" / "hal0d.toml").read_text()
    config.write_text(text.replace(json.dumps(DEMO_STUB_LOG), json.dumps(str(tmp / "stub.log"))))
    with output.open("ab") as out:
        process = subprocess.Popen(make_run_argv(port, config), cwd=tmp, stdout=out,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True)
    try:
        deadline = time.monotonic() + READY_WITHIN_S
        while not slots_ready(port):
            assert process.poll() is None, f"hal0d exited early:\n{output.read_text()[-3000:]}"
            assert time.monotonic() < deadline, output.read_text()[-3000:]
            time.sleep(0.1)
        yield port, output, process
    finally:
        stop(process)


def test_two_make_runs_with_their_ports_run_side_by_side_beside_the_demos_ollama_port(
        tmp_path: Path) -> None:
    """`make run PORT=...` twice, with 11435 (the demo's Ollama port) taken by another program:
    both serve, each with its own Ollama listener, named in its start line and answering."""
    with squatting(DEMO_OLLAMA_PORT), make_run(tmp_path / "one") as (_, first, _), \
            make_run(tmp_path / "two") as (_, second, _):
        addresses = [ollama_address(first), ollama_address(second)]
        assert None not in addresses and addresses[0] != addresses[1], addresses
        for address in addresses:
            assert not str(address).endswith(f":{DEMO_OLLAMA_PORT}"), addresses
            with urllib.request.urlopen(f"http://{address}/api/tags", timeout=5) as resp:
                assert "models" in json.loads(resp.read())


def test_make_run_without_a_port_keeps_the_demos_addresses() -> None:
    printed = subprocess.run(["make", "--no-print-directory", "-n", "run"], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout
    [line] = [line for line in printed.splitlines() if " serve " in line]
    assert "--port" not in line and "--ollama-port" not in line, line
    assert 'port = 8080' in (REPO / "etc" / "hal0d.toml").read_text()
    assert 'listen = "127.0.0.1:11435"' in (REPO / "etc" / "hal0d.toml").read_text()
