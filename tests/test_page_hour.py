"""The status page's last hour in Debian's chromium (tests/test_page.py's browser), against a
`hal0d serve` whose history holds an hour in fast-forward and which then lives through streams, a
stall, swaps, a failed load and unloads: the timeline, each slot's charts and each group's memory
say what GET /api/timeline says, a minute picked on a chart lists its requests, a request picked
in the list is shown where it sat, and at 390 px nothing of it is cut off."""

from __future__ import annotations

import functools
import json
import sys
import time
import urllib.error
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness.daemons import Hal0dPopen
from tests.harness.page import (
    console_errors,
    page_daemon_text,
    request_rows,
    require_chromium,
    screenshot,
    until,
)
from tests.harness.poll import eventually_sync
from tests.harness.ports import free_port

require_chromium()
from selenium.webdriver.common.by import By  # noqa: E402

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
