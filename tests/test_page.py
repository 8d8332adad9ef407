"""The status page in a real browser: Debian's chromium, headless, driven by selenium through
chromium-driver, against a real `hal0d serve` whose slots run the stub.

`make test` installs chromium and chromium-driver when they are missing and it runs as root (as
CI does); elsewhere these tests skip, saying how to run them. Screenshots at 1440x900 and
390x844 are written to the test's folder; docs/dashboard.png is `make screenshot`'s, the page of
the demo `make run` serves (tests/screenshot.py, run here too so the target keeps working).
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness.daemons import Hal0dPopen
from tests.harness.page import (
    PAGE_KEY,
    console_errors,
    page_config_text,
    page_daemon_text,
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


# Read in one script each: finding the elements and then asking each for its text races the page,
# which redraws a list as its events come (a StaleElementReferenceException in between).
def card_state(browser: Any, slot: str) -> str:
    state: str | None = browser.execute_script(
        "const card = document.querySelector(`article.card[data-slot=\"${arguments[0]}\"]`);"
        "return card ? card.getAttribute('data-state') : '';", slot)
    return state or ""


def request_rows(browser: Any) -> list[str]:
    rows: list[str] = browser.execute_script(
        "return [...document.querySelectorAll('#requests tbody tr')].map(row => row.innerText);")
    return rows


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


# -- the last hour -----------------------------------------------------------------------------

HOUR_SLOTS = ("llm", "a", "b")


def seed_history(path: Path, now: float) -> int:
    """The hour before the test, fast-forwarded: rows with past timestamps, written by the real
    HistoryWriter into the file the daemon then opens. Returns how many."""
    import asyncio

    from hal0d.observability.history import HistoryWriter, RequestRecord

    minute = now // 60 * 60
    rows = []
    # Back to 57 minutes, not 59: the page's hour is counted back from when it is read, and the
    # fixture's live part may take two minutes on a busy box; a row at the hour's edge would
    # have slid out of it by then.
    for back in range(2, 58):
        for index, slot in enumerate(HOUR_SLOTS):
            if index and back % (1 + 2 * index) != 1:
                continue  # a every third minute, b every fifth; llm every minute
            for n in range(1 + back % 3):
                ok = (back + n) % 13 != 0
                ttft = 80.0 + 7 * back + 30 * n + 40 * index
                rows.append(RequestRecord(
                    ts=minute - back * 60 + 5 + 17 * n, request_id=f"seed-{slot}-{back}-{n}",
                    slot=slot, model=slot, endpoint="/v1/chat/completions", stream=True,
                    status=200 if ok else 502, ok=ok,
                    error_code=None if ok else "dispatch.upstream_unavailable",
                    queue_ms=float(back % 4) * 40, ttft_ms=ttft if ok else None,
                    total_ms=ttft + 900 + 11 * back, completion_tokens=40 + back + 9 * n))

    async def write() -> None:
        writer = HistoryWriter(path)
        await writer.start()
        for row in rows:
            writer.submit(row)
        await writer.close()

    asyncio.run(write())
    return len(rows)


def hour_config_text(port: int, tmp: Path) -> str:
    stub = [sys.executable, "-m", "hal0d", "stub", "--delay", "0.005"]
    ports = {name: free_port() for name in ("llm", "a", "b", "c", "d")}

    def command(name: str, *extra: str) -> str:
        return json.dumps([*stub, "--port", str(ports[name]), "--log", str(tmp / f"{name}.log"),
                           *extra])

    return page_daemon_text(port, tmp) + f"""
[groups.gpu0]
max_loaded = 1
memory_mib = 24000
free_memory_command = ["echo", "20480"]

[[slots]]
name = "llm"
upstream = "http://127.0.0.1:{ports['llm']}"
models = ["reasoning", "stall"]
command = {command('llm')}
stream_idle_timeout_s = 0.5

[[slots]]
name = "a"
upstream = "http://127.0.0.1:{ports['a']}"
models = ["chat"]
command = {command('a')}
start = "on_demand"
group = "gpu0"
memory_mib = 9000

[[slots]]
name = "b"
upstream = "http://127.0.0.1:{ports['b']}"
models = ["think-only"]
command = {command('b')}
start = "on_demand"
group = "gpu0"
memory_mib = 12000

[[slots]]
name = "c"
upstream = "http://127.0.0.1:{ports['c']}"
models = ["tool"]
command = {command('c', '--fail-start', 'error: out of memory loading the model')}
start = "on_demand"

[[slots]]
name = "d"
upstream = "http://127.0.0.1:{ports['d']}"
models = ["broken"]
command = {command('d')}
start = "on_demand"
idle_unload_s = 1.0
"""


def ask(daemon: Hal0dPopen, model: str, *, stream: bool = False) -> int:
    try:
        daemon.call("/v1/chat/completions", {"model": model, "stream": stream,
                                              "messages": [{"role": "user", "content": "hi"}]})
        return 200
    except urllib.error.HTTPError as exc:
        return exc.code


def api_timeline(daemon: Hal0dPopen) -> dict[str, Any]:
    answer: dict[str, Any] = json.loads(daemon.call("/api/timeline"))
    return answer


@pytest.fixture
def scripted_hour(tmp_path: Path) -> Iterator[Hal0dPopen]:
    """An hour in fast-forward: the history's past hour seeded, then for real: streams, a
    stall, two swaps in a group of one, a failed load, an idle unload and an API unload."""
    seeded = seed_history(tmp_path / "history.sqlite3", time.time())
    port = free_port()
    config = tmp_path / "hal0d.toml"
    config.write_text(hour_config_text(port, tmp_path))
    daemon = Hal0dPopen(port, config, tmp_path / "hal0d.out")
    daemon.start()
    try:
        eventually_sync(lambda: json.loads(daemon.call("/readyz"))["status"] == "ready", 20,
                        "hal0d ready")
        assert [ask(daemon, "reasoning", stream=True) for _ in range(2)] == [200, 200]
        assert ask(daemon, "stall", stream=True) == 200  # ended by the stall guard
        assert [ask(daemon, model) for model in ("chat", "think-only", "chat")] == [200] * 3
        assert ask(daemon, "tool") == 503  # c's load fails
        assert ask(daemon, "broken") == 502  # d loads, its answer is cut; idle, it unloads
        daemon.call("/api/slots/a/unload", {})
        eventually_sync(lambda: any(e["kind"] == "unload" and e["reason"] == "idle"
                                    for e in api_timeline(daemon)["events"]), 15, "d unloaded")
        minutes = api_timeline(daemon)["minutes"]
        assert sum(m["requests"] for m in minutes) == seeded + 8  # the model calls above
        yield daemon
    finally:
        daemon.stop()


def page_marks(browser: Any) -> list[dict[str, Any]]:
    marks: list[dict[str, Any]] = browser.execute_script(
        "return [...document.querySelectorAll('#timeline .mark')].map(m => ({"
        "slot: m.dataset.slot, kind: m.dataset.kind, reason: m.dataset.reason,"
        "ts: Number(m.dataset.ts), stroke: getComputedStyle(m.querySelector('path')).stroke,"
        "label: (m.querySelector('text') || {}).textContent || ''}));")
    return marks


def page_chart_values(browser: Any, slot: str) -> dict[tuple[str, float, str], float]:
    found: list[list[Any]] = browser.execute_script(
        "const card = document.querySelector(`#charts article[data-slot=\"${arguments[0]}\"]`);"
        "return [...card.querySelectorAll('[data-chart]')].flatMap(cell =>"
        " [...cell.querySelectorAll('[data-series]')].map(p => [cell.dataset.chart,"
        " Number(p.dataset.minute), p.dataset.series, Number(p.dataset.value)]));", slot)
    return {(chart, minute, series): value for chart, minute, series, value in found}


def api_chart_values(timeline: dict[str, Any], slot: str) -> dict[tuple[str, float, str], float]:
    values: dict[tuple[str, float, str], float] = {}
    for minute in timeline["minutes"]:
        if minute["slot"] != slot or minute["ts"] < timeline["now"] - 3660:
            continue
        values[("requests", minute["ts"], "ok")] = minute["ok"]
        values[("requests", minute["ts"], "errors")] = minute["errors"]
        for chart in ("tokens_per_s", "ttft_ms", "queue_ms"):
            for series in ("p50", "p95"):
                if minute[chart][series] is not None:
                    values[(chart, minute["ts"], series)] = minute[chart][series]
    return values


def test_after_an_hour_the_timeline_and_charts_show_what_api_timeline_says(
    scripted_hour: Hal0dPopen, browser: Any, tmp_path: Path
) -> None:
    daemon = scripted_hour
    browser.get(daemon.url + "/")
    until("the timeline drawn", lambda: len(page_marks(browser)) > 0, 20)
    truth = api_timeline(daemon)
    told = sorted((e["slot"], e["kind"], e.get("reason") or "", e["ts"]) for e in truth["events"]
                  if e["kind"] != "load")
    marks = page_marks(browser)
    assert sorted((m["slot"], m["kind"], m["reason"], m["ts"]) for m in marks) == told
    unloads = {(m["slot"], m["reason"]) for m in marks if m["kind"] == "unload"}
    assert unloads == {("a", "evicted"), ("b", "evicted"), ("a", "api"), ("d", "idle")}
    assert sum(1 for m in marks if m["kind"] == "loaded") == 5  # llm at start, a, b, a again, d
    failed = [m for m in marks if m["kind"] == "load_failed"]
    assert [m["slot"] for m in failed] == ["c"]
    red = browser.execute_script(
        "const probe = document.createElement('i'); probe.style.color = 'var(--bad)';"
        "document.body.append(probe); const c = getComputedStyle(probe).color; probe.remove();"
        "return c;")
    assert failed[0]["stroke"] == red and failed[0]["label"] == "failed"
    bars = browser.execute_script(
        "return [...document.querySelectorAll('#timeline rect.span')].map(r =>"
        " [r.dataset.slot, r.dataset.state, Number(r.dataset.from)]);")
    assert sorted(map(tuple, bars)) == sorted(
        (s["slot"], s["state"], s["from"]) for s in truth["spans"])

    # Hover shows the times and the reason in a <title>; a tap says the same under the timeline.
    # Marks seconds apart are pixels apart: a tap tells each of those under the finger.
    from selenium.webdriver.common.action_chains import ActionChains

    evicted = browser.find_element(
        By.CSS_SELECTOR, '#timeline .mark[data-kind="unload"][data-reason="evicted"] .hit')
    ActionChains(browser).move_to_element(evicted).click().perform()
    detail = browser.find_element(By.ID, "timeline-detail").text
    when = next(e for e in truth["events"] if e.get("reason") == "evicted")["ts"]
    assert "(evicted)" in detail and time.strftime("%H:%M:%S", time.localtime(when)) in detail

    # The page counts a request live as it ends; /api/timeline's current minute may be read a
    # moment before or after the last one: the two agree once both have it. The hour's oldest
    # minute is in the window or out of it by the clock each side read last (the page's draw is
    # seconds older than this read): the minutes compared are those inside both.
    def agree(slot: str) -> dict[Any, Any] | None:
        page = page_chart_values(browser, slot)
        timeline = api_timeline(daemon)
        inside = timeline["now"] - 3600
        page = {key: value for key, value in page.items() if key[1] >= inside}
        api = {key: value for key, value in api_chart_values(timeline, slot).items()
               if key[1] >= inside}
        return page if page == api else None

    for slot in HOUR_SLOTS:
        page = until(f"{slot}'s charts as /api/timeline says", functools.partial(agree, slot), 5)
        assert len(page) > 20
    axis = browser.execute_script(
        "return [...document.querySelectorAll('#charts article[data-slot=\"llm\"]"
        " [data-chart=\"ttft_ms\"] text.y')].map(t => t.textContent);")
    assert axis[0] == "0 ms" and all(label.endswith(("ms", " s")) for label in axis), axis

    # Memory: the group's budget, what is loaded now, the free memory its command reported.
    memory = browser.execute_script(
        "const p = document.querySelector('#memory [data-group=\"gpu0\"] .memory-now');"
        "return [p.dataset.used, p.dataset.budget, p.dataset.free, p.textContent];")
    group = truth["groups"][0]
    assert memory[:3] == [str(group["used_mib"]), "24000", "20480"], memory
    assert "20480 MiB free" in memory[3]

    # A point on a chart: the list shows that minute's requests of that slot.
    minute = next(m for m in reversed(truth["minutes"]) if m["slot"] == "a"
                  and m["requests"] >= 2 and m["ts"] < truth["now"] - 120)
    hit = f'rect.hit[data-minute="{minute["ts"]:.0f}"]'
    browser.find_element(By.CSS_SELECTOR,
                         f'#charts article[data-slot="a"] [data-chart="ttft_ms"] {hit}').click()
    rows = until("the minute's requests", lambda: browser.find_element(
        By.ID, "minute-filter").is_displayed() and request_rows(browser))
    assert len(rows) == minute["requests"], rows
    listed = browser.execute_script(
        "return [...document.querySelectorAll('#requests tbody tr')]"
        ".map(r => r.dataset.requestId);")
    assert all(rid.startswith("seed-a-") for rid in listed), listed
    browser.find_element(By.CSS_SELECTOR, "#minute-filter button").click()
    until("every request again", lambda: len(request_rows(browser)) > minute["requests"])

    # A request picked in the list: where it sat on the timeline, in its slot's row.
    loaded_a = next(r for r in json.loads(daemon.call("/api/requests?limit=50"))["requests"]
                    if r["slot"] == "a" and r["load_ms"])
    browser.find_element(By.CSS_SELECTOR,
                         f'#requests tr[data-request-id="{loaded_a["request_id"]}"]').click()
    picked = until("the request on the timeline", lambda: browser.execute_script(
        "const g = document.querySelector("
        "`#timeline .picked[data-request-id=\"${arguments[0]}\"]`);"
        "if (!g) return null; const halo = g.querySelector('.halo');"
        "const lane = document.querySelector('#timeline rect.lane[data-slot=\"a\"]');"
        "return {phases: [...g.querySelectorAll('[data-phase]')].map(p => p.dataset.phase),"
        " halo: [halo.y.baseVal.value, halo.height.baseVal.value],"
        " lane: [lane.y.baseVal.value, lane.height.baseVal.value],"
        " row: document.querySelector('#requests tr.picked').dataset.requestId};",
        loaded_a["request_id"]))
    assert picked["row"] == loaded_a["request_id"]
    assert "loading" in picked["phases"] and "serving" in picked["phases"], picked
    (halo_y, halo_h), (lane_y, lane_h) = picked["halo"], picked["lane"]
    assert halo_y <= lane_y and lane_y + lane_h <= halo_y + halo_h, picked
    detail = browser.find_element(By.ID, "timeline-detail").text
    assert loaded_a["request_id"] in detail and "loading" in detail

    # Live: a load after the page opened appears without a reload.
    daemon.call("/api/slots/b/load", {})
    until("b's new load on the timeline", lambda: sum(
        1 for m in page_marks(browser) if m["slot"] == "b" and m["kind"] == "loaded") == 2, 10)
    assert console_errors(browser) == []


def test_at_390_px_nothing_of_the_page_is_cut_off(
    scripted_hour: Hal0dPopen, browser: Any, tmp_path: Path
) -> None:
    browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
        "width": 390, "height": 844, "deviceScaleFactor": 1, "mobile": True})
    browser.get(scripted_hour.url + "/")
    until("the timeline drawn", lambda: len(page_marks(browser)) > 0, 20)
    overflowing = browser.execute_script(
        "const boxes = [document.documentElement, document.body, document.querySelector('header'),"
        " document.querySelector('main'), ...document.querySelectorAll('main section, #timeline,"
        " #charts article, #memory article, .chart-cell, .table-wrap, .cards .card')];"
        "return boxes.filter(b => b.scrollWidth > b.clientWidth)"
        " .map(b => `${b.tagName}#${b.id}.${b.className} ${b.scrollWidth} > ${b.clientWidth}`);")
    assert overflowing == []
    width = browser.execute_script(
        "return document.querySelector('#timeline svg').width.baseVal.value")
    assert width <= 390
    screenshot(browser, tmp_path, 390, 844)
    assert console_errors(browser) == []


# -- the prompt cache --------------------------------------------------------------------------

# Run before the page's own scripts: /api/slots and the event feed's slot views as a hal0d that
# keeps prompt caches shows them (conversations_warm, prompt_cache) for the slot "warm", and as
# one that does not (neither field) for "llm", whichever this hal0d is.
WITH_CACHE_FIELDS = """
(() => {
  const SAVED = %(saved)s;
  const shown = (view) => {
    if (view.name === "warm") {
      Object.assign(view, { conversations_warm: 2, prompt_cache: { saved_at: SAVED,
        saved_tokens: 903, restored_at: SAVED + 60, restored_tokens: 903, failures: 0 } });
    } else {
      delete view.conversations_warm;
      delete view.prompt_cache;
    }
  };
  const views = (data) => { (data.slots || []).forEach(shown); if (data.view) shown(data.view);
    return data; };
  const realFetch = window.fetch;
  window.fetch = async (input, init) => {
    const resp = await realFetch(input, init);
    const path = new URL(String(input), location.href).pathname;
    if (path === "/api/slots") {
      return new Response(JSON.stringify(views(await resp.json())), { status: resp.status });
    }
    if (path !== "/api/events" || !resp.body) return resp;
    let buffer = "";
    const frames = new TransformStream({ transform(text, out) {
      const parts = (buffer + text).split("\\n\\n");
      buffer = parts.pop();
      for (const frame of parts) {
        const lines = frame.split("\\n");
        const at = lines.findIndex((line) => line.startsWith("data: "));
        if (at >= 0 && /^event: (hello|slot)$/m.test(frame)) {
          lines[at] = "data: " + JSON.stringify(views(JSON.parse(lines[at].slice(6))));
        }
        out.enqueue(lines.join("\\n") + "\\n\\n");
      }
    } });
    return new Response(resp.body.pipeThrough(new TextDecoderStream()).pipeThrough(frames)
      .pipeThrough(new TextEncoderStream()), { status: resp.status, headers: resp.headers });
  };
})();
"""


@contextlib.contextmanager
def llama_server_capture() -> Iterator[str]:
    """An upstream on a real port that answers every chat completion with llama-server's
    captured answer tests/fixtures/llama-server/chat-warm.json (903 of its 917 prompt tokens
    taken from the cache)."""
    import http.server
    import threading

    from tests.fixtures_util import fixture_path

    answer = fixture_path("llama-server/chat-warm.json").read_bytes()

    class Handler(http.server.BaseHTTPRequestHandler):
        def reply(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            self.reply(200, b'{"object":"list","data":[]}')

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            found = self.path == "/v1/chat/completions"
            self.reply(200 if found else 404, answer if found else b"{}")

        def log_message(self, *_: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def card_facts(browser: Any, slot: str) -> dict[str, str]:
    facts: dict[str, str] = browser.execute_script(
        "const card = document.querySelector(`article.card[data-slot=\"${arguments[0]}\"]`);"
        "if (!card) return {}; const out = {};"
        "card.querySelectorAll('dt').forEach(dt => { out[dt.textContent] ="
        " dt.nextElementSibling.textContent; }); return out;", slot)
    return facts


def test_a_slots_card_shows_the_cached_share_of_its_prompts_and_its_saved_cache(
    tmp_path: Path, browser: Any
) -> None:
    port = free_port()
    config = tmp_path / "hal0d.toml"
    saved = time.time() - 120
    with llama_server_capture() as upstream:
        config.write_text(page_config_text(port, tmp_path, keys=False) + f"""
[[slots]]
name = "warm"
upstream = "{upstream}"
models = ["smol"]
""")
        daemon = Hal0dPopen(port, config, tmp_path / "hal0d.out")
        daemon.start()
        try:
            browser.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument",
                                    {"source": WITH_CACHE_FIELDS % {"saved": saved}})
            browser.get(daemon.url + "/")
            until("the warm slot ready", lambda: card_state(browser, "warm") == "ready", 20)
            until("the llm slot ready", lambda: card_state(browser, "llm") == "ready", 20)
            assert "cache" not in card_facts(browser, "warm")  # nothing asked of it yet
            for _ in range(2):
                daemon.call("/v1/chat/completions", {"model": "smol", "messages": [
                    {"role": "user", "content": "hi"}]})
            daemon.call("/v1/chat/completions", {"model": "chat", "messages": [
                {"role": "user", "content": "hi"}]})
            facts = until("the cached share", lambda: "cache" in card_facts(browser, "warm")
                          and card_facts(browser, "warm"), 5)
            assert facts["cache"] == "98 % of prompt tokens"  # 2 x 903 of 2 x 917
            title = browser.execute_script(
                "return [...document.querySelectorAll('article.card[data-slot=\"warm\"] dt')]"
                ".find(dt => dt.textContent === 'cache').nextElementSibling.firstChild.title;")
            assert title.startswith("1806 of 1834 prompt tokens"), title
            assert facts["warm"] == "2 conversations"
            at = [time.strftime("%H:%M:%S", time.localtime(saved + s)) for s in (0, 60)]
            assert facts["saved cache"] == f"saved 903 tokens at {at[0]}, restored 903 at {at[1]}"
            # A slot whose view has neither field (a hal0d from before them): neither line.
            plain = card_facts(browser, "llm")
            assert {"warm", "saved cache"} & set(plain) == set(), plain
            assert console_errors(browser) == []
            screenshot(browser, tmp_path, 1440, 900)
            browser.execute_script(
                "document.querySelector('article.card[data-slot=\"warm\"]').scrollIntoView();")
            screenshot(browser, tmp_path, 390, 844)
        finally:
            daemon.stop()
