"""The status page's Groups section in Debian's chromium (tests/test_page.py's browser): each swap
group of /api/slots as a card that says what is loaded and when its turn ends, who waits and in
what order, what its swaps cost and the share of the hour they took, the wait bound and each
model's longest wait. A real `hal0d serve` with a group of max_loaded = 1 and two on-demand stub
slots swaps for real; a group view with every key (and one with none but its name) is shown by
handing the page's own fetch an edited /api/slots, as a hal0d newer or older than this one
would answer."""

from __future__ import annotations

import json
import re
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
    serving_text,
    until,
)
from tests.harness.ports import free_port

require_chromium()

LOAD_S = "0.2"  # the stub's --startup-delay: a swap costs a little more than this


def groups_config_text(port: int, tmp: Path) -> str:
    """The group `gpu` of max_loaded = 1 and its two on-demand slots: `a` serves chat, `b`
    think-only (the stub's own models)."""
    stub = [sys.executable, "-m", "hal0d", "stub", "--delay", "0.005", "--startup-delay", LOAD_S]
    ports = {name: free_port() for name in ("a", "b")}
    slots = "".join(f"""
[[slots]]
name = "{name}"
upstream = "http://127.0.0.1:{ports[name]}"
models = ["{model}"]
command = {json.dumps([*stub, "--port", str(ports[name]), "--log", str(tmp / f"{name}.log")])}
start = "on_demand"
group = "gpu"
""" for name, model in (("a", "chat"), ("b", "think-only")))
    return page_daemon_text(port, tmp) + """
[groups.gpu]
max_loaded = 1
max_wait_s = 2.0
""" + slots


@pytest.fixture
def grouped(tmp_path: Path) -> Iterator[Hal0dPopen]:
    with serving_text(tmp_path, lambda port: groups_config_text(port, tmp_path)) as daemon:
        yield daemon


def group_card(browser: Any, name: str) -> dict[str, Any] | None:
    """The card's title, state and facts (term: text), read in one script (the page redraws
    it every second)."""
    card: dict[str, Any] | None = browser.execute_script(
        "const card = document.querySelector(`#groups article[data-group=\"${arguments[0]}\"]`);"
        "if (!card || card.closest('[hidden]')) return null;"
        "const facts = {}; card.querySelectorAll('dt').forEach(dt => {"
        " facts[dt.textContent] = dt.nextElementSibling.innerText.replaceAll('\\u00a0', ' '); });"
        "return {title: card.querySelector('h3').innerText, state: card.dataset.state,"
        " limits: (card.querySelector('.models')?.innerText || '').replaceAll('\\u00a0', ' '),"
        " facts};", name)
    return card


def phone_screenshot(browser: Any, folder: Path) -> Path:
    """The Groups section at the top of a 390x844 screen, once nothing in it is cut off."""
    browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
        "width": 390, "height": 844, "deviceScaleFactor": 1, "mobile": True})
    # Scrolled before the new width is laid out, the page would forget where it was.
    until("the page at a phone's width", lambda: browser.execute_script(
        "return window.innerWidth") == 390)
    browser.execute_script("document.getElementById('groups-title').scrollIntoView()")
    overflowing = browser.execute_script(
        "return [...document.querySelectorAll('#groups, #groups .card, #groups dd')]"
        ".filter(b => b.scrollWidth > b.clientWidth).map(b => b.outerHTML.slice(0, 80));")
    assert overflowing == []
    return screenshot(browser, folder, 390, 844)


def ask(daemon: Hal0dPopen, model: str) -> None:
    daemon.call("/v1/chat/completions", {"model": model,
                                          "messages": [{"role": "user", "content": "hi"}]})


def test_a_groups_card_shows_its_loaded_model_its_turn_and_after_a_swap_what_swaps_cost(
    grouped: Hal0dPopen, browser: Any, tmp_path: Path
) -> None:
    browser.get(grouped.url + "/")
    card = until("the group's card", lambda: group_card(browser, "gpu"), 20)
    assert card["title"].split() == ["gpu", "batch"], card
    assert card["facts"]["loaded"] == "nothing loaded"
    assert card["facts"]["swaps"] == "no swap measured yet"
    assert card["facts"]["in use"] == "0 of 1 loaded" and "max_wait_s 2 s" in card["limits"], card
    ask(grouped, "chat")
    card = until("a loaded, its turn counted down", lambda: (c := group_card(browser, "gpu"))
                 and c["facts"]["loaded"].startswith("a: turn ") and c, 5)
    assert card["state"] == "ready" and card["facts"]["in use"] == "1 of 1 loaded", card
    assert card["facts"]["swaps"] == "no swap measured yet"  # a load into room is no swap
    ask(grouped, "think-only")  # a has no work: it makes room at once
    card = until("b loaded and the swap measured", lambda: (c := group_card(browser, "gpu"))
                 and c["facts"]["loaded"].startswith("b: ") and "measured" in c["facts"]["swaps"]
                 and c, 5)
    swaps = card["facts"]["swaps"]
    assert swaps.startswith("1 measured, ") and "each (median)" in swaps, swaps
    assert "swapping " in swaps and "% since hal0d started" in swaps, swaps
    assert card["facts"]["longest wait"] == "no request waits", card
    assert console_errors(browser) == []
    assert screenshot(browser, tmp_path, 1440, 900).stat().st_size > 10_000
    assert phone_screenshot(browser, tmp_path).stat().st_size > 5_000


# Run before the page's own scripts: /api/slots answers these groups instead of its own, as a
# hal0d would with every key of a group's view (`busy`), with only a name (`bare`), with nulls
# where it has nothing to say (`quiet`), and with a name that is markup, to be shown as text.
WITH_GROUPS = """
(() => {
  const GROUPS = %s;
  const realFetch = window.fetch;
  window.fetch = async (input, init) => {
    const resp = await realFetch(input, init);
    if (new URL(String(input), location.href).pathname !== "/api/slots") return resp;
    const body = await resp.json();
    body.groups = GROUPS;
    return new Response(JSON.stringify(body), { status: resp.status });
  };
})();
"""
BUSY = {
    "name": "busy", "policy": "batch", "max_loaded": 1, "memory_mib": 24000, "max_wait_s": 30.0,
    "min_turn_loads": 3.0, "max_swap_share": 0.2, "loaded": ["a"], "turn_s": 45.0,
    "turn_ends_in_s": {"a": 200.0}, "turn_order": ["b", "c"],
    "pending_swap": {"waiting": "b", "victim": "a", "waited_s": 12.0, "max_wait_s": 30.0,
                     "turn_at_s": 45.0, "why": "waiting for b's turn: 12 s of 45"},
    "swaps": 4, "swap_cost_s": 8.25, "swap_share": 0.34, "wait_bound_s": 106.5,
    "longest_wait_s": {"b": 12.0, "c": 3.0},
}
QUIET = {key: None for key in BUSY} | {"name": "quiet", "swaps": 0, "swap_share": 0.0}
MARKUP = {"name": "<img src=x onerror=alert(1)>", "loaded": ["<b>x</b>"]}


def test_a_groups_card_shows_every_key_there_is_and_leaves_out_a_missing_one(
    grouped: Hal0dPopen, browser: Any, tmp_path: Path
) -> None:
    groups = [BUSY, {"name": "bare"}, QUIET, MARKUP]
    browser.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument",
                            {"source": WITH_GROUPS % json.dumps(groups)})
    browser.get(grouped.url + "/")
    busy = until("the busy group's card", lambda: group_card(browser, "busy"), 20)
    facts = busy["facts"]
    assert busy["state"] == "starting" and busy["title"].split() == ["busy", "batch"], busy
    assert re.fullmatch(r"a: turn ends in 3 min 1[5-9] s|a: turn ends in 3 min 20 s",
                        facts["loaded"]), facts  # 200 s, counted down every second
    assert facts["in use"] == "1 of 1 loaded, 0 of 24000 MiB", facts  # no slot of it here
    assert facts["turn"] == "45 s for a busy model"
    assert facts["turn order"].split() == ["b", "c"], facts  # an ordered list, numbered by CSS
    assert facts["swap"] == "waiting for b's turn: 12 s of 45"
    assert facts["swaps"].splitlines() == [
        "4 measured, 8.3 s each (median)", "swapping 34 % since hal0d started (target ≤ 20 %)"]
    over = browser.execute_script(
        "return getComputedStyle(document.querySelector('#groups .over')).fontWeight")
    assert over == "600"  # above the target: in the warning colour, bold
    assert facts["wait bound"] == "a request waits at most 1 min 47 s for its model's turn"
    assert facts["longest wait"].startswith("b 1"), facts  # 12 s and counting
    assert group_card(browser, "bare") == {"title": "bare", "state": "stopped", "limits": "",
                                           "facts": {"loaded": "nothing loaded"}}
    quiet = group_card(browser, "quiet")
    assert quiet is not None and quiet["facts"] == {
        "loaded": "nothing loaded", "swaps": "no swap measured yet"}, quiet
    markup = group_card(browser, MARKUP["name"])
    assert markup is not None and markup["facts"]["loaded"] == "<b>x</b>", markup
    assert browser.execute_script("return document.querySelectorAll('#groups img, #groups b')"
                                  ".length") == 0
    assert console_errors(browser) == []
    browser.execute_script("document.getElementById('groups-title').scrollIntoView()")
    screenshot(browser, tmp_path, 1440, 900)
    phone_screenshot(browser, tmp_path)
