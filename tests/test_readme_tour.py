"""Every command of the README's "A short tour", run as typed (bash and curl) against `make run`'s
configuration, each checked against what the README says it shows.

The commands are read from README.md itself, so the tour cannot drift from what hal0d does: a
command added to the tour without an expectation here fails, and so does an expectation whose
command left the tour.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.demo import REPO, RunningDemo, running_demo

STATUS_LINE = re.compile(r"\n@@status=(\d{3})\n$")


def tour_commands() -> list[str]:
    """The tour's shell block, one entry per command (continuation lines kept, comments off)."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("\n## A short tour\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    commands: list[str] = []
    current: list[str] = []
    for line in block.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current.append(line)
        if not line.endswith("\\"):
            commands.append("\n".join(current))
            current = []
    assert not current, f"the tour ends inside a command: {current}"
    return commands


@dataclass
class Answer:
    status: int
    body: str
    seconds: float

    def json(self) -> Any:
        return json.loads(self.body)

    def sse_data(self) -> list[str]:
        return [line[len("data: "):] for line in self.body.splitlines()
                if line.startswith("data: ")]


def streamed_reasoning(answer: Answer) -> None:
    data = answer.sse_data()
    assert data[-1] == "[DONE]"
    assert any('"reasoning_content"' in chunk for chunk in data)
    assert any('"content":"' in chunk for chunk in data)


def whole_chat(answer: Answer) -> None:
    assert answer.json()["choices"][0]["message"]["content"]


def model_list(answer: Answer) -> None:
    ids = {model["id"] for model in answer.json()["data"]}
    assert {"reasoning", "chat", "stall"} <= ids


def slot_states(answer: Answer) -> None:
    slots = answer.json()["slots"]
    assert [(slot["name"], slot["state"]) for slot in slots] == [("llm", "ready")]


def alive(answer: Answer) -> None:
    assert answer.json()["status"] == "ok"


def ready(answer: Answer) -> None:
    assert answer.json()["status"] == "ready"


def unknown_model(answer: Answer) -> None:
    error = answer.json()["error"]
    assert error["code"] == "dispatch.no_route"
    assert "gpt-9" in error["message"] and "reasoning" in error["message"]


def stall_guard_frame(answer: Answer) -> None:
    data = answer.sse_data()
    assert data[-1] == "[DONE]"
    frame = json.loads(data[-2])
    assert frame["choices"][0]["finish_reason"] == "length"
    assert "stall guard" in frame["choices"][0]["delta"]["content"]
    assert frame["x_hal0_stall"]["reason"] == "idle"
    # "after the demo's 3 s": the demo slot's own idle bound, not the production 5 minutes.
    assert frame["x_hal0_stall"]["stream_idle_timeout_s"] == 3
    assert answer.seconds < 3 + 2


def anthropic_events(answer: Answer) -> None:
    events = [line[len("event: "):] for line in answer.body.splitlines()
              if line.startswith("event: ")]
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_delta" in events
    assert "[DONE]" not in answer.body


def history(answer: Answer) -> None:
    rows = answer.json()["requests"]
    assert 1 <= len(rows) <= 5
    assert {"model", "slot", "status", "ok"} <= set(rows[0])


# A distinctive part of each tour command, and what the README says it shows.
EXPECTED: dict[str, tuple[int, Callable[[Answer], None]]] = {
    '"model":"reasoning","stream":true': (200, streamed_reasoning),
    '"model":"chat"': (200, whole_chat),
    "/v1/models": (200, model_list),
    "/api/slots": (200, slot_states),
    "/healthz": (200, alive),
    "/readyz": (200, ready),
    '"model":"gpt-9"': (404, unknown_model),
    '"model":"stall"': (200, stall_guard_frame),
    "/llm/v1/messages": (200, anthropic_events),
    "/api/requests": (200, history),
}
COMMANDS = tour_commands()


def expectation_of(command: str) -> str:
    keys = [key for key in EXPECTED if key in command]
    assert len(keys) == 1, f"the tour command {command!r} matches expectations {keys}"
    return keys[0]


def test_every_tour_command_has_one_expectation_and_every_expectation_a_command() -> None:
    assert sorted(expectation_of(command) for command in COMMANDS) == sorted(EXPECTED)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDemo]:
    for tool in ("bash", "curl"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed; the tour is curl commands")
    with running_demo(tmp_path_factory.mktemp("tour")) as running:
        yield running


@pytest.fixture(scope="module")
def curl_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A .curlrc that makes each command, typed as in the README, also print its status."""
    home = tmp_path_factory.mktemp("curl-home")
    (home / ".curlrc").write_text('silent\nshow-error\nwrite-out = "\\n@@status=%{http_code}\\n"\n')
    return home


@pytest.mark.parametrize("command", COMMANDS, ids=[expectation_of(c) for c in COMMANDS])
def test_a_tour_command_shows_what_the_readme_says(
    demo: RunningDemo, curl_home: Path, command: str
) -> None:
    status, check = EXPECTED[expectation_of(command)]
    started = time.monotonic()
    done = subprocess.run(
        ["bash", "-c", demo.as_typed_for_make_run(command)], capture_output=True, text=True,
        timeout=30, env={"PATH": "/usr/bin:/bin", "CURL_HOME": str(curl_home)},
    )
    seconds = time.monotonic() - started
    assert done.returncode == 0, (done.stderr, demo.diagnostics())
    found = STATUS_LINE.search(done.stdout)
    assert found is not None, done.stdout[-500:]
    answer = Answer(int(found.group(1)), done.stdout[: found.start()], seconds)
    assert answer.status == status, (answer.body[-1000:], demo.diagnostics())
    check(answer)
