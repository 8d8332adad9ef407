"""The status page's Devices section in Debian's chromium (tests/test_page.py's browser): on the
simulated box of two 24 GiB GPUs (a real `hal0d serve` reading it through its devices_command,
a desktop holding 2 GiB of the first, a stub slot loaded onto the second), each GPU is a card
with one bar of its memory: the slot's share with its MiB, other programs, free, and the margin
placement keeps hatched over its end; the same in words; its free memory over the hour. The page
reads /api/devices again by itself (the desktop's memory freed shows without a reload); a read
that fails is one line; and a hal0d that reads no devices shows no section at all."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness.daemons import Hal0dPopen
from tests.harness.gpu_box import devices_command
from tests.harness.gpu_page import BoxSlot, gpu_page_daemon, make_gpu_box
from tests.harness.page import (
    console_errors,
    page_config_text,
    require_chromium,
    screenshot,
    serving_text,
    until,
)

require_chromium()

GIB = 1024
LLM = BoxSlot("llm", "chat", 6000, device=1)
READ_S = 20  # a stub's load and the page's next read of /api/devices (every 5 s), on a busy box


@pytest.fixture
def box(tmp_path: Path) -> Path:
    path = tmp_path / "box.json"
    make_gpu_box(path, [24 * GIB, 24 * GIB], desktop={0: 2 * GIB})
    return path


@pytest.fixture
def on_the_box(tmp_path: Path, box: Path) -> Iterator[Hal0dPopen]:
    with gpu_page_daemon(tmp_path, box, [LLM]) as daemon:
        yield daemon


# Read in one script: the page redraws the section at each read.
PANEL = """
const section = document.getElementById('devices-section');
if (!section || section.hidden) return null;
const text = (node) => node ? node.innerText.replaceAll('\\u00a0', ' ') : null;
const error = section.querySelector('.device-error');
return {
  source: text(section.querySelector('.device-source')),
  error: error.hidden ? null : text(error),
  devices: [...section.querySelectorAll('article.device')].map((card) => {
    const bar = card.querySelector('.device-bar').getBoundingClientRect();
    const margin = card.querySelector('.device-bar .margin');
    const box = margin && margin.getBoundingClientRect();
    return {
      index: Number(card.dataset.device), title: text(card.querySelector('h3')),
      figures: text(card.querySelector('.device-figures')),
      parts: [...card.querySelectorAll('.device-bar .part')].map((part) => ({
        kind: part.classList.contains('slot') ? 'slot' : part.classList[1],
        slot: part.dataset.slot || null, mib: Number(part.dataset.mib),
        share: part.getBoundingClientRect().width / bar.width})),
      margin: margin && {share: box.width / bar.width, right: bar.right - box.right,
                         title: margin.title.replaceAll('\\u00a0', ' ')},
      legend: [...card.querySelectorAll('.device-legend .key')].map(text),
      history: card.querySelector('.device-history figcaption').textContent
        .replaceAll('\\u00a0', ' '),
      lines: card.querySelectorAll('.sparkline polyline').length,
    };
  }),
};
"""


def panel(browser: Any) -> dict[str, Any] | None:
    shown: dict[str, Any] | None = browser.execute_script(PANEL)
    return shown


def shown_panel(browser: Any) -> dict[str, Any]:
    """The section as drawn; not yet (an AssertionError, to `until`) while it is hidden."""
    shown = panel(browser)
    assert shown is not None, "the devices section is hidden"
    return shown


def device(shown: dict[str, Any], index: int) -> dict[str, Any]:
    found = [d for d in shown["devices"] if d["index"] == index]
    assert found, f"no device {index} shown: {shown}"
    return found[0]


def parts(card: dict[str, Any]) -> list[tuple[str, str | None, int]]:
    return [(p["kind"], p["slot"], p["mib"]) for p in card["parts"]]


@pytest.fixture
def plain(tmp_path: Path) -> Iterator[Hal0dPopen]:
    """The page tests' own hal0d (tests/harness/page.py), with no [devices]."""
    with serving_text(tmp_path, lambda port: page_config_text(port, tmp_path, keys=False)) as it:
        yield it


def api_devices(daemon: Hal0dPopen) -> dict[str, Any]:
    with urllib.request.urlopen(daemon.url + "/api/devices", timeout=10) as resp:
        view: dict[str, Any] = json.loads(resp.read())
    return view


def loaded(browser: Any) -> dict[str, Any]:
    shown = shown_panel(browser)
    assert ("slot", "llm", 6000) in parts(device(shown, 1)), shown
    return shown


def desktop_gone(browser: Any) -> dict[str, Any]:
    first = device(shown_panel(browser), 0)
    assert [kind for kind, _, _ in parts(first)] == ["free"], first
    return first


def with_error(browser: Any) -> dict[str, Any]:
    shown = shown_panel(browser)
    assert shown["error"], shown
    return shown


def test_each_gpu_shows_its_slots_other_programs_free_and_the_margin_in_one_bar(
    on_the_box: Hal0dPopen, box: Path, browser: Any, tmp_path: Path
) -> None:
    browser.get(on_the_box.url + "/")
    shown = until("the llm slot's share of GPU 1", lambda: loaded(browser), READ_S)
    assert [d["index"] for d in shown["devices"]] == [0, 1], shown
    assert shown["source"].startswith("from devices_command, read at "), shown
    assert shown["error"] is None
    first, second = device(shown, 0), device(shown, 1)
    assert first["title"].split() == ["GPU", "0", "sim-24G"], first
    assert parts(first) == [("other", None, 2048), ("free", None, 22528)]
    assert first["legend"] == ["other programs 2048 MiB", "free 22528 MiB", "margin 512 MiB"]
    assert first["figures"] == "used 2.0 of 24.0 GiB, 22.0 GiB free (a new model may take 21.5 GiB)"
    assert parts(second) == [("slot", "llm", 6000), ("free", None, 18576)]
    assert second["legend"] == ["llm 6000 MiB", "free 18576 MiB", "margin 512 MiB"]
    assert second["figures"].startswith("used 5.9 of 24.0 GiB, 18.1 GiB free"), second
    # To scale: the slot's part of the bar is its share of the device, the margin's at its end.
    slot_part = second["parts"][0]
    assert abs(slot_part["share"] - 6000 / 24576) < 0.01, slot_part
    assert abs(second["margin"]["share"] - 512 / 24576) < 0.01, second["margin"]
    assert abs(second["margin"]["right"]) <= 2, second["margin"]
    assert "keeps 512 MiB free" in second["margin"]["title"]
    assert second["history"].startswith("free memory since "), second
    assert "lowest 18.1 GiB at" in second["history"]
    assert second["lines"] >= 1
    view = api_devices(on_the_box)
    assert [d["free_mib"] for d in view["devices"]] == [22528, 18576]  # the page's own figures
    assert console_errors(browser) == []
    screenshot(browser, tmp_path, 1440, 900)

    subprocess.run([*devices_command(box), "--release", "desktop"], check=True, timeout=30)
    first = until("the desktop's memory freed, read again without a reload",
                  lambda: desktop_gone(browser), READ_S)
    assert first["legend"] == ["free 24576 MiB", "margin 512 MiB"], first


def test_a_read_that_fails_is_one_line_and_no_device(tmp_path: Path, browser: Any) -> None:
    failing = [sys.executable, "-c", "print('not json')"]
    with serving_text(tmp_path, lambda port: page_config_text(port, tmp_path, keys=False)
                      + f"\n[devices]\ndevices_command = {json.dumps(failing)}\n") as daemon:
        browser.get(daemon.url + "/")
        shown = until("the read's error", lambda: with_error(browser), READ_S)
        assert shown["error"].startswith("The devices could not be read: devices_command: "), shown
        assert "\n" not in shown["error"] and shown["devices"] == [], shown
        assert api_devices(daemon)["error"] in shown["error"]


# Run before the page's own scripts: counts the page's reads of /api/devices once each is drawn
# (the count moves in a task of its own, after the read's body was handed on and drawn).
COUNT_READS = """
(() => {
  window.devicesRead = 0;
  const realFetch = window.fetch;
  window.fetch = async (input, init) => {
    const resp = await realFetch(input, init);
    if (new URL(String(input), location.href).pathname !== "/api/devices") return resp;
    const body = await resp.json();
    const handed = new Response(null, { status: resp.status });
    handed.json = async () => { setTimeout(() => { window.devicesRead += 1; }); return body; };
    return handed;
  };
})();
"""


def test_a_hal0d_that_reads_no_devices_shows_no_devices_section(
    plain: Hal0dPopen, browser: Any
) -> None:
    if api_devices(plain)["source"] is not None:
        pytest.skip("this machine has a GPU hal0d reads: its page shows the devices")
    browser.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": COUNT_READS})
    browser.get(plain.url + "/")
    until("the page's first read of /api/devices, drawn",
          lambda: browser.execute_script("return window.devicesRead") >= 1, READ_S)
    assert panel(browser) is None
    assert browser.execute_script(
        "return document.querySelectorAll('#devices-section article').length") == 0
    assert browser.execute_script(
        "return document.querySelectorAll('article.card[data-slot]').length") == 2
    assert console_errors(browser) == []


# Run before the page's own scripts: /api/devices answers this view instead of its own, as an
# AMD APU's would (GTT), with a slot's process, one of a slot this page does not list, another
# program's, memory the driver names no process for, reads that failed for five minutes, and a
# device name that is markup, to be shown as text.
READ_AT = 1767225600.0
HISTORY = [[READ_AT - 3540 + 60 * i, 1024 if i == 20 else 4096] for i in range(60)
           if not 25 <= i < 30]
APU = {
    "source": "amdsmi", "error": None, "read_at": READ_AT, "margin_mib": 1024,
    "devices": [{
        "index": 0, "name": "<img src=x onerror=alert(1)>", "total_mib": 16384,
        "used_mib": 12288, "free_mib": 4096, "other_mib": 2048,
        "gtt": {"total_mib": 65536, "used_mib": 8192},
        "processes": [{"pid": 10, "used_mib": 6144, "slot": "llm"},
                      {"pid": 12, "used_mib": 4096, "slot": "gone"},
                      {"pid": 11, "used_mib": 1024, "slot": None}],
        "history": HISTORY,
    }],
}
WITH_DEVICES = """
(() => {
  const VIEW = %s;
  const realFetch = window.fetch;
  window.fetch = async (input, init) => {
    const resp = await realFetch(input, init);
    if (new URL(String(input), location.href).pathname !== "/api/devices") return resp;
    return new Response(JSON.stringify(VIEW), { status: resp.status });
  };
})();
"""


def test_a_device_shows_gtt_every_holder_and_a_gap_where_reads_failed(
    plain: Hal0dPopen, browser: Any
) -> None:
    browser.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument",
                            {"source": WITH_DEVICES % json.dumps(APU)})
    browser.get(plain.url + "/")
    shown = until("the APU", lambda: device(shown_panel(browser), 0), READ_S)
    assert shown["title"] == "GPU 0 <img src=x onerror=alert(1)>", shown
    assert browser.execute_script("return document.querySelectorAll('#devices-section img')"
                                  ".length") == 0
    assert shown["figures"] == ("used 12.0 of 16.0 GiB, 4.0 GiB free (a new model may take "
                                "3.0 GiB); GTT used 8.0 of 64.0 GiB"), shown
    # The page's own slot first, in its colour; then the one it does not list.
    assert parts(shown) == [("slot", "llm", 6144), ("slot", "gone", 4096),
                            ("other", None, 2048), ("free", None, 4096)]
    assert shown["legend"] == ["llm 6144 MiB", "gone 4096 MiB", "other programs 2048 MiB",
                               "free 4096 MiB", "margin 1024 MiB"]
    other = browser.execute_script(
        "return document.querySelector('#devices-section .part.other').title")
    assert other.replace("\u00a0", " ") == (
        "other programs (no slot's): pid 11: 1024 MiB, 1024 MiB the driver names no "
        "process for")
    assert shown["history"].startswith("free memory over the last hour"), shown
    assert "lowest 1.0 GiB at " in shown["history"]
    assert shown["lines"] == 2  # broken where five minutes of reads are missing
    assert shown["margin"]["share"] == pytest.approx(1024 / 16384, abs=0.01)
    assert console_errors(browser) == []
