"""The harness's own promise that a test could not see fail: the watch that fails a test whose
hal0d logged a line only a bug writes finds such a line in process (under a test's own
capture_logs too), in a daemon's log file, and in hal0d's pipeline pointed at a buffer. An event
name of this test's own stands for lifecycle.task_failed, which the watch every test runs under
(conftest's hal0d_logged_no_bug) would fail this test on."""

from __future__ import annotations

from pathlib import Path

import structlog
from structlog.testing import capture_logs

from tests.harness.logs import logs_into_buffer, watch_log, watching_for_bugs

BUG = "harness.bug_of_this_test"


def test_a_bug_line_is_found_in_process_in_a_daemons_log_and_in_a_buffer(tmp_path: Path) -> None:
    log = structlog.get_logger()
    daemon_log = tmp_path / "hal0d.log"
    wrapper = structlog.get_config()["wrapper_class"]
    with watching_for_bugs((BUG,)) as watch:
        with capture_logs() as captured:
            log.error(BUG, task="_run_job", error="RuntimeError('refused')")
        assert [entry["event"] for entry in captured] == [BUG]  # the test's capture still sees it
        log.info("harness.not_a_bug", task="other")
        daemon_log.write_text(f'{{"event": "server.started"}}\n{{"event": "{BUG}", "task": "b"}}\n')
        watch_log(daemon_log)
        with logs_into_buffer("logfmt", "warning"):
            log.error(BUG, task="c")
            log.info(BUG, task="below the level: not written")
    found = watch.found()
    assert found[0] == f"in process: {BUG} task='_run_job' error=\"RuntimeError('refused')\""
    assert found[1] == f'{daemon_log}: {{"event": "{BUG}", "task": "b"}}'
    assert found[2].startswith("logs_into_buffer: ") and found[2].endswith(f"{BUG} task=c")
    assert len(found) == 3, found
    # Outside the block nothing more is watched, and structlog is as it was.
    log.error(BUG, task="after")
    assert len(watch.found()) == 3
    assert structlog.get_config()["wrapper_class"] is wrapper
