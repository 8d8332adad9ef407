"""The Anthropic streaming surface checked the way a person checks it by hand against `make run`:
three shell pipelines (curl | grep), run literally with bash against a real `hal0d serve` started
from a copy of etc/hal0d.toml.

Only the ports and the stub's log path are rewritten, so the test can run beside `make run` and
beside itself; everything else, the stub command included, is the demo configuration.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator

import pytest

from tests.demo import RunningDemo, running_demo


class Daemon(RunningDemo):
    def run(self, text: str, timeout: float = 20.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", "-c", self.as_typed_for_make_run(text)],
                              capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    for tool in ("bash", "curl", "grep", "timeout", "head"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed; these checks are shell pipelines")
    with running_demo(tmp_path_factory.mktemp("verify")) as demo:
        yield Daemon(**vars(demo))


# The commands exactly as typed against `make run`; Daemon.run points them at the test's own
# daemon. Each one's expected result is the comment under it, which the test below it asserts.
VERIFY_1 = """curl -N -s localhost:8080/llm/v1/messages -H 'content-type: application/json' \\
  -d '{"model":"reasoning","max_tokens":64,"stream":true,"messages":[{"role":"user","content":"hi"}]}' \\
  | grep '^event:'"""  # noqa: E501
# expected: message_start, content_block_start, content_block_delta..., content_block_stop,
#           content_block_start, content_block_delta..., content_block_stop, message_delta,
#           message_stop

VERIFY_2 = """curl -N -s localhost:8080/llm/v1/messages -H 'content-type: application/json' \\
  -d '{"model":"reasoning","max_tokens":64,"stream":true,"messages":[{"role":"user","content":"hi"}]}' \\
  | grep -n -E 'content_block_stop|"index":1' | head -3"""  # noqa: E501
# expected: the index 0 content_block_stop line precedes the first line mentioning index 1

VERIFY_3 = """timeout 1 curl -N -s localhost:8080/llm/v1/messages -H 'content-type: application/json' \\
  -d '{"model":"reasoning","max_tokens":512,"stream":true,"messages":[{"role":"user","content":"long"}]}' >/dev/null"""  # noqa: E501
VERIFY_3_COUNT = "grep -c 'cancelled' /tmp/stub-reasoning.log"
# expected: 1 within a second of the client going away


def test_verify_1_event_lines_come_in_the_expected_order(daemon: Daemon) -> None:
    result = daemon.run(VERIFY_1)
    assert result.returncode == 0, (result.stderr, daemon.diagnostics())
    lines = result.stdout.splitlines()
    assert all(line.startswith("event: ") for line in lines), lines
    names = [line[len("event: "):] for line in lines]
    folded: list[str] = []
    for name in names:
        if not (name == "content_block_delta" and folded[-1] == "content_block_delta..."):
            folded.append("content_block_delta..." if name == "content_block_delta" else name)
    assert folded == [
        "message_start",
        "content_block_start", "content_block_delta...", "content_block_stop",
        "content_block_start", "content_block_delta...", "content_block_stop",
        "message_delta", "message_stop",
    ], names


def test_verify_2_index0_block_stop_precedes_the_first_line_mentioning_index1(
    daemon: Daemon,
) -> None:
    result = daemon.run(VERIFY_2)
    lines = result.stdout.splitlines()
    assert len(lines) == 3, (result.stdout, result.stderr, daemon.diagnostics())
    numbered = [(int(line.split(":", 1)[0]), line.split(":", 1)[1]) for line in lines]
    assert [n for n, _ in numbered] == sorted(n for n, _ in numbered)
    stop_0 = [n for n, text in numbered
              if "content_block_stop" in text and '"index":1' not in text]
    first_1 = [n for n, text in numbered if '"index":1' in text]
    assert stop_0 and first_1, lines
    assert stop_0[0] < first_1[0], lines
    # the index-0 stop is the first thing grep finds: event line, then its data line
    assert numbered[0][1] == "event: content_block_stop", lines
    assert numbered[1][1] == 'data: {"type":"content_block_stop","index":0}', lines
    assert numbered[2][1].startswith('data: {"type":"content_block_start","index":1,'), lines


def test_verify_3_client_gone_after_1s_makes_the_stub_log_one_cancelled_within_a_second(
    daemon: Daemon,
) -> None:
    started = time.monotonic()
    result = daemon.run(VERIFY_3)
    gone = time.monotonic()
    assert result.returncode == 124, (result, daemon.diagnostics())  # timeout cut curl off
    assert 0.9 <= gone - started < 3.0, gone - started
    count = ""
    while True:
        count = daemon.run(VERIFY_3_COUNT).stdout.strip()
        if count == "1" or time.monotonic() - gone > 1.0:
            break
        time.sleep(0.05)
    assert count == "1", daemon.diagnostics()
    assert time.monotonic() - gone <= 1.2
    long_request = [line for line in daemon.stub_lines() if "endpoint=chat" in line][-2:]
    assert long_request[0].split()[1] == "start" and long_request[1].split()[1] == "cancelled"
