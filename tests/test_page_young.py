"""The status page of a hal0d a newcomer has just started (Debian's chromium, as in
tests/test_page.py): nothing configured it does not show (no memory where no group or slot has a
memory_mib, no "warm" cache where no prompt cache is kept), what it can measure of whole answers,
each group's room ("2 of 2 loaded"), and the last hour scaled to the minutes hal0d has run, its
labels apart."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness.daemons import Hal0dPopen
from tests.harness.page import (
    console_errors,
    page_daemon_text,
    require_chromium,
    screenshot,
    until,
)
from tests.harness.ports import free_port

require_chromium()
from selenium.webdriver.common.by import By  # noqa: E402

STUB = [sys.executable, "-m", "hal0d", "stub", "--delay", "0.005"]


def slot(tmp: Path, name: str, models: list[str], extra: str = "", *args: str) -> str:
    port = free_port()
    command = [*STUB, "--port", str(port), "--log", str(tmp / f"{name}.log"), *args]
    return f"""
[[slots]]
name = "{name}"
upstream = "http://127.0.0.1:{port}"
models = {json.dumps(models)}
command = {json.dumps(command)}
{extra}
"""


def young_config_text(port: int, tmp: Path) -> str:
    """`llm` (always loaded, no prompt cache), `kept` (its prompt cache saved), the group `gpu`
    of two on-demand slots and no memory configured, and the group `mem` with a budget and one
    slot of 9000 MiB."""
    return page_daemon_text(port, tmp) + """
[groups.gpu]
max_loaded = 2

[groups.mem]
max_loaded = 1
memory_mib = 24000
""" + "".join([
        slot(tmp, "llm", ["chat"]),
        slot(tmp, "kept", ["reasoning"], 'prompt_cache = "save"',
             "--slot-save-path", "{prompt_cache_dir}"),
        slot(tmp, "a", ["a"], 'start = "on_demand"\ngroup = "gpu"'),
        slot(tmp, "b", ["b"], 'start = "on_demand"\ngroup = "gpu"'),
        slot(tmp, "m", ["m"], 'start = "on_demand"\ngroup = "mem"\nmemory_mib = 9000'),
    ])


@pytest.fixture
def young(tmp_path: Path) -> Iterator[Hal0dPopen]:
    port = free_port()
    config = tmp_path / "hal0d.toml"
    config.write_text(young_config_text(port, tmp_path))
    daemon = Hal0dPopen(port, config, tmp_path / "hal0d.out")
    daemon.start()
    try:
        until("hal0d ready", lambda: json.loads(daemon.call("/readyz"))["status"] == "ready", 20)
        yield daemon
    finally:
        daemon.stop()


def ask(daemon: Hal0dPopen, model: str, *, stream: bool = False) -> None:
    daemon.call("/v1/chat/completions", {"model": model, "stream": stream,
                                          "messages": [{"role": "user", "content": "hi"}]})


def facts(browser: Any, selector: str) -> dict[str, str]:
    """A card's facts (term: text), read in one script: the page redraws its cards."""
    found: dict[str, str] = browser.execute_script(
        "const card = document.querySelector(arguments[0]); if (!card) return {};"
        "const out = {}; card.querySelectorAll('dt').forEach(dt => {"
        " out[dt.textContent] = dt.nextElementSibling.textContent.replaceAll('\\u00a0', ' '); });"
        "return out;", selector)
    return found


def slot_facts(browser: Any, name: str) -> dict[str, str]:
    return facts(browser, f'#slots article[data-slot="{name}"]')


def test_memory_is_shown_only_where_configured_and_each_group_says_how_full_it_is(
    young: Hal0dPopen, browser: Any, tmp_path: Path
) -> None:
    for name in "abm":
        young.call(f"/api/slots/{name}/load", {})
    browser.get(young.url + "/")
    until("a, b and m loaded", lambda: browser.execute_script(
        "return [...document.querySelectorAll('#slots article[data-state=\"ready\"]')]"
        ".map(card => card.dataset.slot).sort().join(' ')") == "a b kept llm m", 20)
    # No memory_mib in the group gpu, none on llm: no memory line, not "gpu: 0 MiB in use".
    for name in ("llm", "kept", "a", "b"):
        assert "memory" not in slot_facts(browser, name), (name, slot_facts(browser, name))
    assert slot_facts(browser, "m")["memory"] == "mem: 9000 of 24000 MiB in use"
    gpu = until("gpu's card", lambda: facts(browser, '#groups article[data-group="gpu"]'))
    assert gpu["in use"] == "2 of 2 loaded", gpu
    mem = facts(browser, '#groups article[data-group="mem"]')
    assert mem["in use"] == "1 of 1 loaded, 9000 of 24000 MiB", mem
    # The memory charts: mem's alone (gpu's would be a flat line at 0).
    charts = until("the memory charts", lambda: browser.execute_script(
        "return [...document.querySelectorAll('#memory article')].map(a => a.dataset.group);"))
    assert charts == ["mem"], charts
    assert browser.find_element(By.ID, "memory-title").is_displayed()
    assert console_errors(browser) == []
    screenshot(browser, tmp_path, 1440, 900)


def test_whole_answers_show_their_speed_and_say_why_they_have_no_ttft(
    young: Hal0dPopen, browser: Any
) -> None:
    browser.get(young.url + "/")
    until("the llm card", lambda: slot_facts(browser, "llm"), 20)
    ask(young, "chat")
    row = until("the whole answer's row", lambda: browser.execute_script(
        "const row = document.querySelector('#requests tbody tr'); if (!row) return null;"
        "const cells = [...row.cells].map(c => c.textContent);"
        "return {ttft: cells[7], speed: cells[8], title: row.cells[7].firstChild.title};"))
    assert row["ttft"] == "whole answer" and "no first token" in row["title"], row
    assert float(row["speed"]) > 0, row
    card = until("the card's figures", lambda: (f := slot_facts(browser, "llm"))
                 and f["TTFT p50 / p95"] != "– / –" and f)
    assert card["TTFT p50 / p95"] == "whole answers only", card
    assert card["tok/s"].endswith(" (whole answer)") and float(card["tok/s"].split()[0]) > 0
    # A stream after it: its own TTFT and speed, measured from its first token.
    ask(young, "chat", stream=True)
    card = until("the stream's TTFT", lambda: (f := slot_facts(browser, "llm"))
                 and f["TTFT p50 / p95"].endswith(" ms") and f)
    assert not card["tok/s"].endswith("(whole answer)"), card
    assert console_errors(browser) == []


def test_warm_conversations_are_called_saved_only_where_a_prompt_cache_is_kept(
    young: Hal0dPopen, browser: Any
) -> None:
    browser.get(young.url + "/")
    until("the cards", lambda: slot_facts(browser, "kept"), 20)
    assert "warm" not in slot_facts(browser, "llm")  # no conversation yet, no cache: no line
    ask(young, "chat")
    ask(young, "reasoning")
    browser.get(young.url + "/")  # the count is the slot view's, read when the page opens
    llm = until("llm's conversation", lambda: slot_facts(browser, "llm").get("warm"))
    assert llm == "1 conversation in the server's memory, not saved"
    kept = until("kept's conversation", lambda: slot_facts(browser, "kept").get("warm"))
    assert kept == "1 conversation"  # its prompt cache is saved: warm, as said
    assert console_errors(browser) == []


def overlaps(browser: Any) -> list[str]:
    """Each pair of the timeline's words (axis times, marks' reasons) whose boxes touch, and
    each reason drawn over another mark of its row."""
    found: list[str] = browser.execute_script("""
      const box = (node) => node.getBoundingClientRect();
      const hit = (a, b) => a.left < b.right && b.left < a.right
        && a.top < b.bottom && b.top < a.bottom;
      const words = [...document.querySelectorAll('#timeline text.axis, #timeline .mark-label')];
      const out = [];
      words.forEach((a, i) => words.slice(i + 1).forEach((b) => {
        if (hit(box(a), box(b))) out.push(`${a.textContent} / ${b.textContent}`);
      }));
      for (const label of document.querySelectorAll('#timeline .mark-label')) {
        const own = label.closest('.mark');
        const row = `#timeline .mark[data-slot="${own.dataset.slot}"]`;
        for (const mark of document.querySelectorAll(row)) {
          if (mark !== own && hit(box(label), box(mark.querySelector('path')))) {
            out.push(`${label.textContent} over ${mark.dataset.kind}`);
          }
        }
      }
      return out;""")
    return found


def test_a_young_hal0d_s_timeline_spans_the_minutes_it_has_run_and_its_labels_do_not_overlap(
    young: Hal0dPopen, browser: Any, tmp_path: Path
) -> None:
    # Loads and unloads seconds apart: several marks and their reasons within a minute.
    for name in "abm":
        young.call(f"/api/slots/{name}/load", {})
    for name, action in (("a", "unload"), ("a", "load"), ("b", "unload"), ("b", "load"),
                         ("a", "unload"), ("m", "unload")):
        young.call(f"/api/slots/{name}/{action}", {})
    browser.get(young.url + "/")
    until("the marks drawn", lambda: browser.execute_script(
        "return document.querySelectorAll('#timeline .mark[data-kind=\"unload\"]').length") >= 4,
          20)
    # The seconds the lane spans, from where two marks of known times are drawn.
    drawn = browser.execute_script(
        "const marks = [...document.querySelectorAll('#timeline .mark')]"
        " .map(m => [Number(m.dataset.ts), Number(m.dataset.x)]).sort((a, b) => a[0] - b[0]);"
        "const [first, last] = [marks[0], marks[marks.length - 1]];"
        "return {lane: document.querySelector('#timeline rect.lane').width.baseVal.value,"
        " seconds: last[0] - first[0], pixels: last[1] - first[1],"
        " title: document.getElementById('hour-title').textContent,"
        " ticks: [...document.querySelectorAll('#timeline text.axis')].map(t => t.textContent)};")
    assert drawn["seconds"] > 2, drawn
    span = drawn["lane"] * drawn["seconds"] / drawn["pixels"]
    assert 170 <= span <= 600, drawn  # the few minutes it has run, not the hour
    assert drawn["title"] == "Since hal0d started", drawn
    assert len(drawn["ticks"]) >= 2, drawn  # the minutes on the clock under it
    assert overlaps(browser) == []
    screenshot(browser, tmp_path, 1440, 900)
    browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
        "width": 390, "height": 844, "deviceScaleFactor": 1, "mobile": True})
    until("the page at a phone's width", lambda: browser.execute_script(
        "return document.querySelector('#timeline svg').width.baseVal.value") <= 390, 5)
    assert overlaps(browser) == []
    screenshot(browser, tmp_path, 390, 844)
    assert console_errors(browser) == []
