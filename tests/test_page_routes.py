"""The status page in Debian's chromium (tests/test_page.py's browser and daemon) for what a route
and a slot in error look like there: each [[routes]] model as a card in its best slot's state,
its slots in order each in its own, kept live from the feed; and on the timeline a slot in error
drawn in the error colour, not as a loaded (green) bar."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness.daemons import Hal0dPopen
from tests.harness.page import (
    console_errors,
    require_chromium,
    route_config_text,
    screenshot,
    serving_text,
    until,
)
from tests.harness.ports import free_port

require_chromium()


@pytest.fixture
def routed(tmp_path: Path) -> Iterator[Hal0dPopen]:
    """test_page's daemon, with a slot where nothing listens (`gone`: in error once probed)
    and the route `either` over it and the on-demand slot (at rest)."""
    gone = f"http://127.0.0.1:{free_port()}"
    with serving_text(tmp_path, lambda port: route_config_text(
            port, tmp_path, gone, "ondemand", "think-only")) as daemon:
        yield daemon


def route_card(browser: Any, model: str) -> dict[str, Any] | None:
    card: dict[str, Any] | None = browser.execute_script(
        "const card = document.querySelector(`#routes article[data-route=\"${arguments[0]}\"]`);"
        "if (!card || card.closest('[hidden]')) return null;"
        "return {state: card.dataset.state, text: card.innerText,"
        " slots: [...card.querySelectorAll('li')].map(li => [li.dataset.slot, li.dataset.state])};",
        model)
    return card


def test_a_route_shows_as_a_card_in_its_best_slots_state_and_follows_its_slots_live(
    routed: Hal0dPopen, browser: Any, tmp_path: Path
) -> None:
    browser.get(routed.url + "/")
    card = until("the route's card, gone in error", lambda: (
        c := route_card(browser, "either")) and c["slots"][0] == ["gone", "error"] and c, 20)
    # gone is in error, ondemand at rest: stopped (the next request loads it) is the best.
    assert card["state"] == "stopped", card
    assert card["slots"] == [["gone", "error"], ["ondemand", "stopped"]]
    assert "best slot: ondemand" in card["text"] and "as think-only" in card["text"], card
    routed.call("/api/slots/ondemand/load", {})
    card = until("the route ready once ondemand is loaded", lambda: (
        c := route_card(browser, "either")) and c["state"] == "ready" and c, 5)
    assert card["slots"] == [["gone", "error"], ["ondemand", "ready"]]
    assert console_errors(browser) == []
    screenshot(browser, tmp_path, 1440, 900)
    browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
        "width": 390, "height": 844, "deviceScaleFactor": 1, "mobile": True})
    browser.execute_script("document.getElementById('routes-title').scrollIntoView()")
    overflowing = browser.execute_script(
        "return [...document.querySelectorAll('#routes, #routes .card, #routes li')]"
        ".filter(b => b.scrollWidth > b.clientWidth).map(b => b.outerHTML.slice(0, 80));")
    assert overflowing == []
    screenshot(browser, tmp_path, 390, 844)


def test_a_slot_in_error_is_drawn_in_the_error_colour_on_the_timeline(
    routed: Hal0dPopen, browser: Any
) -> None:
    timeline = json.loads(routed.call("/api/timeline"))
    spans = [span["state"] for span in timeline["spans"] if span["slot"] == "gone"]
    assert spans == ["error"], timeline["spans"]
    browser.get(routed.url + "/")
    drawn = until("gone's lane drawn", lambda: browser.execute_script(
        "const spans = [...document.querySelectorAll('#timeline .span[data-slot=\"gone\"]')];"
        "const probe = document.createElement('span');"
        "probe.style.color = 'var(--bad)'; document.body.append(probe);"
        "const bad = getComputedStyle(probe).color; probe.remove();"
        "return spans.length ? {classes: spans.map(s => s.getAttribute('class')),"
        " fills: spans.map(s => getComputedStyle(s).fill), bad} : null;"), 20)
    assert drawn["classes"] == ["span error"], drawn
    assert drawn["fills"] == [drawn["bad"]], drawn
    assert console_errors(browser) == []
