"""The status page in a real browser: Debian's chromium, headless, driven by selenium through
chromium-driver, against a real `hal0d serve` whose slots run the stub.

`make test` installs chromium and chromium-driver when they are missing and it runs as root (as
CI does); elsewhere these tests skip, saying how to run them. Screenshots at 1440x900 and
390x844 are written to the test's folder; docs/dashboard.png is `make screenshot`'s, the page of
the demo `make run` serves (tests/screenshot.py, run here too so the target keeps working).
The last hour's pictures are tests/test_page_hour.py's, a slot card's prompt cache
tests/test_page_cache.py's.
"""

from __future__ import annotations

import http.server
import json
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness.daemons import Hal0dPopen
from tests.harness.page import (
    PAGE_KEY,
    card_state,
    console_errors,
    page_config_text,
    request_rows,
    require_chromium,
    route_config_text,
    screenshot,
    serving_text,
    until,
)
from tests.harness.poll import eventually_sync
from tests.harness.ports import free_port

require_chromium()
from selenium.webdriver.common.by import By  # noqa: E402


def serve(tmp: Path, *, keys: bool = False) -> Iterator[Hal0dPopen]:
    with serving_text(tmp, lambda port: page_config_text(port, tmp, keys=keys)) as daemon:
        yield daemon


@pytest.fixture
def hal0d(tmp_path: Path) -> Iterator[Hal0dPopen]:
    yield from serve(tmp_path)


@pytest.fixture
def keyed(tmp_path: Path) -> Iterator[Hal0dPopen]:
    yield from serve(tmp_path, keys=True)


# -- the tests ---------------------------------------------------------------------------------


def test_the_page_loads_live_with_no_console_error_and_shows_each_request_within_2_s(
    hal0d: Hal0dPopen, browser: Any, tmp_path: Path
) -> None:
    browser.get(hal0d.url + "/")
    until("the llm slot card", lambda: card_state(browser, "llm") in ("ready", "starting"), 20)
    until("the on-demand slot at rest", lambda: card_state(browser, "ondemand") == "stopped")
    until("the live feed", lambda: not browser.find_element(By.ID, "notice").is_displayed(), 5)
    before = len(request_rows(browser))
    until("the slot ready", lambda: card_state(browser, "llm") == "ready", 20)
    made = subprocess.run(  # made with curl, as a person would
        ["curl", "-sS", f"{hal0d.url}/v1/chat/completions",
         "-d", '{"model":"chat","messages":[{"role":"user","content":"hi"}]}'],
        capture_output=True, text=True, timeout=30,
    )
    assert made.returncode == 0 and '"choices"' in made.stdout, made
    rows = until("the request in the list", lambda: len(request_rows(browser)) > before
                 and request_rows(browser))
    assert "chat" in rows[0] and "ok" in rows[0]
    # A little of everything for the screenshots: streams, a stall trip, a model loaded on demand.
    for model in ("reasoning", "stall", "reasoning", "think-only"):
        hal0d.call("/v1/chat/completions", {"model": model, "stream": True,
                                             "messages": [{"role": "user", "content": "hi"}]})
    until("every request listed", lambda: len(request_rows(browser)) >= before + 5)
    until("the on-demand slot loaded", lambda: card_state(browser, "ondemand") == "ready")
    assert console_errors(browser) == []
    assert screenshot(browser, tmp_path, 1440, 900).stat().st_size > 10_000
    assert screenshot(browser, tmp_path, 390, 844).stat().st_size > 5_000


def timed_stream(hal0d: Hal0dPopen) -> float:
    """Seconds for a whole streamed answer (the stub paces its tokens 5 ms apart)."""
    started = time.monotonic()
    raw = hal0d.call("/v1/chat/completions", {"model": "reasoning", "stream": True,
                                               "messages": [{"role": "user", "content": "hi"}]})
    assert raw.endswith(b"data: [DONE]\n\n") and b"x_hal0_stall" not in raw, raw[-300:]
    return time.monotonic() - started


def test_a_page_left_open_does_not_slow_a_stream(hal0d: Hal0dPopen, browser: Any) -> None:
    """The page follows /api/events while streams run: a stream takes no longer with it open
    (a generous bound: the feed carries a few events per request, none per chunk)."""
    eventually_sync(lambda: json.loads(hal0d.call("/readyz"))["status"] == "ready", 20,
                    "hal0d ready")
    alone = min(timed_stream(hal0d) for _ in range(3))
    browser.get(hal0d.url + "/")
    until("the live feed", lambda: card_state(browser, "llm") == "ready"
          and not browser.find_element(By.ID, "notice").is_displayed(), 20)
    watched = min(timed_stream(hal0d) for _ in range(3))
    until("the page saw the streams", lambda: len(request_rows(browser)) >= 6)
    assert watched < alone + 0.5, (alone, watched)
    assert console_errors(browser) == []


def test_unload_and_load_buttons_drive_an_on_demand_slot(hal0d: Hal0dPopen, browser: Any) -> None:
    """From http://localhost:PORT/ (the other tests use 127.0.0.1): the page's own origin and
    Host are let in, its POSTs (which carry that Origin) included."""
    browser.get(hal0d.url.replace("127.0.0.1", "localhost") + "/")
    until("the on-demand card", lambda: card_state(browser, "ondemand") == "stopped", 10)
    load = browser.find_element(By.CSS_SELECTOR,
                                'article[data-slot="ondemand"] button[data-action="load"]')
    load.click()
    until("loaded", lambda: card_state(browser, "ondemand") == "ready", 15)
    unload = browser.find_element(By.CSS_SELECTOR,
                                  'article[data-slot="ondemand"] button[data-action="unload"]')
    unload.click()
    until("stopped after Unload", lambda: card_state(browser, "ondemand") == "stopped")
    browser.find_element(By.CSS_SELECTOR,
                         'article[data-slot="ondemand"] button[data-action="load"]').click()
    until("ready after Load", lambda: card_state(browser, "ondemand") == "ready", 15)
    assert console_errors(browser) == []


def test_a_stall_guard_trip_shows_its_error_code(hal0d: Hal0dPopen, browser: Any) -> None:
    browser.get(hal0d.url + "/")
    until("the llm slot ready", lambda: card_state(browser, "llm") == "ready", 20)
    hal0d.call("/v1/chat/completions", {"model": "stall", "stream": True,
                                         "messages": [{"role": "user", "content": "hi"}]})
    row = until("the stalled request", lambda: next(
        (text for text in request_rows(browser) if "stall" in text.split()[1:2]), None))
    assert "stall guard: idle" in row


def test_with_keys_the_page_shows_nothing_before_the_key_and_everything_after(
    keyed: Hal0dPopen, browser: Any
) -> None:
    browser.get(keyed.url + "/")
    form = until("the key form", lambda: browser.find_element(By.ID, "key-form").is_displayed()
                 and browser.find_element(By.ID, "key-form"), 5)
    assert not browser.find_element(By.ID, "live").is_displayed()
    assert browser.find_elements(By.CSS_SELECTOR, "article.card") == []
    form.find_element(By.ID, "key").send_keys(PAGE_KEY)
    form.find_element(By.CSS_SELECTOR, "button").click()
    until("the slots after the key", lambda: card_state(browser, "llm") != "", 5)
    # Its process may still be starting on a busy machine: a request then would find no one.
    until("the llm slot ready", lambda: card_state(browser, "llm") == "ready", 20)
    keyed.call("/v1/chat/completions", {"model": "chat",
                                         "messages": [{"role": "user", "content": "hi"}]},
               key=PAGE_KEY)
    until("a request, live, with the key", lambda: any("chat" in row
                                                       for row in request_rows(browser)))
    # Kept for the next visit, in this browser only; never in a URL.
    assert browser.execute_script("return localStorage.getItem('hal0d.api_key')") == PAGE_KEY
    assert PAGE_KEY not in browser.current_url
    assert PAGE_KEY not in keyed.tail()


def test_a_restarted_hal0d_shows_the_reconnecting_notice_then_live_data_again(
    hal0d: Hal0dPopen, browser: Any
) -> None:
    browser.get(hal0d.url + "/")
    until("live", lambda: card_state(browser, "llm") != "", 20)
    hal0d.stop()
    notice = browser.find_element(By.ID, "notice")
    until("the reconnecting notice", lambda: notice.is_displayed()
          and "reconnecting" in notice.text, 5)
    hal0d.start()
    until("the notice gone", lambda: not notice.is_displayed(), 10)
    until("the slot again", lambda: card_state(browser, "llm") == "ready", 20)
    hal0d.call("/v1/chat/completions", {"model": "chat",
                                         "messages": [{"role": "user", "content": "hi"}]})
    until("a request after the restart", lambda: any("chat" in row
                                                     for row in request_rows(browser)))


class _Refusing(http.server.BaseHTTPRequestHandler):
    """An upstream that answers its probe and refuses every request (503)."""

    def _answer(self, status: int) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def do_GET(self) -> None:
        self._answer(200)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self._answer(503)

    def log_message(self, *args: Any) -> None:
        pass


def test_a_request_a_route_handed_on_names_the_slot_it_passed(
    tmp_path: Path, browser: Any
) -> None:
    refusing = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    threading.Thread(target=refusing.serve_forever, daemon=True).start()
    port = free_port()
    config = tmp_path / "hal0d.toml"
    config.write_text(route_config_text(
        port, tmp_path, f"http://127.0.0.1:{refusing.server_address[1]}", "llm", "chat"))
    daemon = Hal0dPopen(port, config, tmp_path / "hal0d.out")
    daemon.start()
    try:
        browser.get(daemon.url + "/")
        until("the llm slot ready", lambda: card_state(browser, "llm") == "ready", 20)
        daemon.call("/v1/chat/completions", {"model": "either",
                                              "messages": [{"role": "user", "content": "hi"}]})
        row = until("the handed-on request", lambda: next(
            (text for text in request_rows(browser) if text.split()[1:2] == ["either"]), None))
        assert "llm after gone" in row, row
        title = browser.execute_script(
            "return document.querySelector('#requests tbody tr td:nth-child(3)').title;")
        assert title == "handed on by gone=status_503", title
        assert console_errors(browser) == []
    finally:
        daemon.stop()
        refusing.shutdown()


def test_make_screenshot_photographs_the_page_of_the_demo_make_run_serves(tmp_path: Path) -> None:
    from tests import screenshot as target

    made = target.make(tmp_path / "dashboard.png")
    assert [path.name for path in made] == ["dashboard.png", "dashboard-390.png"]
    for path in made:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
