"""The status page's Keys section in Debian's chromium (tests/test_page.py's browser): a real
`hal0d serve` with keys of both classes, quotas and requests without a key, its slot the stub
taking one request at a time. With a key of the admin scope the page shows a card per key: its
class as a badge, its weight, its tokens per minute over the hour, its share of the tokens over
the share window, each quota's use of its limit with the local time it resets, and its requests
in flight and queued as they come and go, read again by itself. A key with only the `read`
scope sees the rest of the page and no section at all (and no warning), and is not asked
again; a hal0d without [[keys]] shows none either."""

from __future__ import annotations

import contextlib
import json
import re
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.harness.daemons import Hal0dPopen
from tests.harness.page import (
    console_errors,
    page_config_text,
    page_daemon_text,
    require_chromium,
    screenshot,
    serving_text,
    until,
)
from tests.harness.ports import free_port

require_chromium()
from selenium.webdriver.common.by import By  # noqa: E402

SECRETS = {"chat": "sk-page-chat-0123456789", "nightly": "sk-page-nightly-0123456789",
           "kids": "sk-page-kids-0123456789", "ops": "sk-page-ops-0123456789",
           "viewer": "sk-page-viewer-0123456789"}
NAMES = ["chat", "nightly", "kids", "ops", "viewer", "anonymous"]
READ_S = 20  # the page reads /api/keys every 5 s; a busy box may be slower


def keys_config_text(port: int, tmp: Path) -> str:
    """One stub slot that answers one request at a time; requests without a key may call it
    (from loopback); `chat` interactive, `nightly` batch of weight 2 with a day's quota, `kids`
    with an hour's quota one answer uses up, `ops` the operator's page key (read, admin) and
    `viewer` a page key with `read` alone."""
    stub = [sys.executable, "-m", "hal0d", "stub", "--delay", "0.005"]
    upstream = free_port()
    anonymous = 'anonymous = { scopes = ["inference"] }\n'
    return page_daemon_text(port, tmp, anonymous) + f"""
[[slots]]
name = "llm"
upstream = "http://127.0.0.1:{upstream}"
models = ["chat", "reasoning"]
command = {json.dumps([*stub, "--port", str(upstream), "--log", str(tmp / "llm.log")])}
max_concurrent = 1

[[keys]]
name = "chat"
key = "{SECRETS['chat']}"
scopes = ["inference"]

[[keys]]
name = "nightly"
key = "{SECRETS['nightly']}"
scopes = ["inference"]
class = "batch"
weight = 2
tokens_per_day = 100000

[[keys]]
name = "kids"
key = "{SECRETS['kids']}"
scopes = ["inference"]
tokens_per_hour = 50

[[keys]]
name = "ops"
key = "{SECRETS['ops']}"
scopes = ["read", "admin"]

[[keys]]
name = "viewer"
key = "{SECRETS['viewer']}"
scopes = ["read"]
"""


@pytest.fixture
def keyed(tmp_path: Path) -> Iterator[Hal0dPopen]:
    with serving_text(tmp_path, lambda port: keys_config_text(port, tmp_path)) as daemon:
        until("the slot ready", lambda: ready(daemon), 20)
        yield daemon


def ready(daemon: Hal0dPopen) -> bool:
    """/readyz answers 200 (503 while the slot's stub starts)."""
    try:
        daemon.call("/readyz")
    except urllib.error.HTTPError as exc:
        assert exc.code == 503, exc
        return False
    return True


def open_with_key(browser: Any, daemon: Hal0dPopen, who: str) -> None:
    """The page in a browser that was given `who`'s key before (it keeps it in localStorage;
    tests/test_page.py gives it in the page's form): no read is refused for want of a key."""
    browser.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {
        "source": f"localStorage.setItem('hal0d.api_key', {json.dumps(SECRETS[who])});"})
    browser.get(daemon.url + "/")
    until("the page live", lambda: browser.execute_script(
        "return document.querySelectorAll('#slots article.card').length") == 1, 10)


def ask(daemon: Hal0dPopen, who: str | None, model: str = "chat", **extra: Any) -> bytes:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}
    return daemon.call("/v1/chat/completions", body, key=SECRETS[who] if who else None)


def api_keys(daemon: Hal0dPopen) -> dict[str, dict[str, Any]]:
    """GET /api/keys with the operator's key, by key name."""
    view = json.loads(daemon.call("/api/keys", key=SECRETS["ops"]))
    return {line["name"]: line for line in view["keys"]}


# Read in one script: the page redraws the section at each read.
PANEL = """
const section = document.getElementById('keys-section');
if (!section || section.hidden) return null;
const text = (node) => node ? node.innerText.replaceAll('\\u00a0', ' ') : null;
return {
  window: text(section.querySelector('.keys-window')),
  keys: [...section.querySelectorAll('article.key-card')].map((card) => ({
    name: card.dataset.key, badge: text(card.querySelector('.key-class')),
    about: text(card.querySelector('.models')),
    hour: text(card.querySelector('.key-hour .latest')),
    bars: [...card.querySelectorAll('.key-spark rect')].map((bar) => Number(bar.dataset.tokens)),
    facts: Object.fromEntries([...card.querySelectorAll('dt')].map(
      (dt) => [dt.textContent, text(dt.nextElementSibling)])),
    quotas: Object.fromEntries([...card.querySelectorAll('.quota')].map((quota) => {
      const meter = quota.querySelector('.meter').getBoundingClientRect();
      return [quota.dataset.per, {
        label: text(quota.querySelector('p > .muted')),
        figures: text(quota.querySelector('.quota-figures')),
        state: ['full', 'near'].find((cls) => quota.classList.contains(cls)) || 'ok',
        filled: quota.querySelector('.fill').getBoundingClientRect().width / meter.width}];
    })),
  })),
};
"""


def panel(browser: Any) -> dict[str, Any] | None:
    shown: dict[str, Any] | None = browser.execute_script(PANEL)
    return shown


def cards(browser: Any) -> dict[str, dict[str, Any]]:
    """The cards by key name; none yet (an AssertionError, to `until`) while hidden."""
    shown = panel(browser)
    assert shown is not None, "the keys section is hidden"
    return {card["name"]: card for card in shown["keys"]}


def plain(text: str) -> str:
    """`text` with its figures' group separators taken out, whatever the browser's locale."""
    return re.sub(r"(?<=\d)[,.\u202f\u00a0 ](?=\d{3}\b)", "", text)


def local_hhmm(ts: float) -> str:
    return time.strftime("%H:%M", time.localtime(ts))


def tokens_shown(browser: Any, view: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The cards once each shows the tokens `view` (/api/keys, read after the last request)
    counts: the page has read /api/keys since."""
    shown = cards(browser)
    for name, line in view.items():
        assert sum(shown[name]["bars"]) == sum(line["last_hour_tokens"]), (name, shown[name])
    return shown


def test_a_card_per_key_shows_its_class_weight_hour_share_and_quotas(
    keyed: Hal0dPopen, browser: Any, tmp_path: Path
) -> None:
    open_with_key(browser, keyed, "ops")
    shown = until("a card per key", lambda: cards(browser), READ_S)
    assert list(shown) == NAMES
    assert all(card["hour"] == "none" and card["bars"] == [] for card in shown.values()), shown
    for who in ("chat", "chat", "nightly", "kids", None):
        ask(keyed, who)
    view = api_keys(keyed)
    assert view["nightly"]["window_tokens"] > 0 and view["kids"]["quotas"]["hour"]["used"] > 50
    shown = until("every request's tokens, read again without a reload",
                  lambda: tokens_shown(browser, view), READ_S)

    chat, nightly, kids = shown["chat"], shown["nightly"], shown["kids"]
    assert chat["badge"] == "interactive" and nightly["badge"] == "batch", shown
    assert chat["about"] == "weight 1" and nightly["about"] == "weight 2"
    assert shown["anonymous"]["about"] == "requests without a key · weight 1"
    for name in ("chat", "nightly", "anonymous"):
        line = view[name]
        assert plain(shown[name]["hour"]) == f"{sum(line['last_hour_tokens'])} tokens"
        share = f"{round(line['window_share'] * 100)} % · {line['window_tokens']} tokens"
        assert plain(shown[name]["facts"]["share"]) == share, shown[name]
    assert shown["ops"]["facts"]["share"] == "no tokens"
    assert chat["quotas"] == {} and list(nightly["quotas"]) == ["day"]

    day = view["nightly"]["quotas"]["day"]
    quota = nightly["quotas"]["day"]
    assert quota["label"] == "day quota" and quota["state"] == "ok", quota
    assert plain(quota["figures"]) == (
        f"{day['used']} / 100000 · resets {local_hhmm(day['resets_at'])}"), quota
    assert quota["filled"] == pytest.approx(day["used"] / 100000, abs=0.01)
    # One answer used the kids' hour up: the bar full, the figures in the error colour.
    hour = view["kids"]["quotas"]["hour"]
    used_up = kids["quotas"]["hour"]
    assert used_up["state"] == "full" and used_up["filled"] == pytest.approx(1.0), used_up
    assert plain(used_up["figures"]) == (
        f"{hour['used']} / 50 · used up until {local_hhmm(hour['resets_at'])}"), used_up
    assert all(card["facts"]["requests"] == "0 in flight, 0 queued" for card in shown.values())
    assert cards_text(browser).startswith("Keys shares of the tokens used in the last 10 min; "
                                          "batch work goes first after waiting 2 min")
    assert console_errors(browser) == []
    browser.execute_script("document.getElementById('keys-title').scrollIntoView()")
    assert screenshot(browser, tmp_path, 1440, 900).stat().st_size > 10_000


def cards_text(browser: Any) -> str:
    text: str = browser.execute_script(
        "return document.getElementById('keys-section').innerText.replaceAll('\\u00a0', ' ')")
    return text


@contextlib.contextmanager
def streaming(daemon: Hal0dPopen, who: str) -> Iterator[None]:
    """A long stream of `who`'s (20 s of tokens), read while the block runs, left when it ends
    (hal0d ends it then)."""
    body = json.dumps({"model": "reasoning", "stream": True, "max_tokens": 4000,
                       "messages": [{"role": "user", "content": "long"}]}).encode()
    request = urllib.request.Request(
        daemon.url + "/v1/chat/completions", data=body,
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {SECRETS[who]}"})
    leave = threading.Event()
    with urllib.request.urlopen(request, timeout=30) as resp:
        def read() -> None:
            while not leave.is_set() and resp.readline():
                pass

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            yield
        finally:
            leave.set()
            reader.join(timeout=10)


def requests_of(browser: Any) -> dict[str, str]:
    return {name: card["facts"]["requests"] for name, card in cards(browser).items()}


def test_a_keys_requests_in_flight_and_queued_show_as_they_come_and_go(
    keyed: Hal0dPopen, browser: Any
) -> None:
    open_with_key(browser, keyed, "ops")
    until("a card per key", lambda: cards(browser), READ_S)
    with ThreadPoolExecutor(1) as pool:
        with streaming(keyed, "nightly"):
            # The slot takes one request at a time: the chat waits behind the batch stream.
            chat = pool.submit(ask, keyed, "chat")
            now = until("the stream in flight and the chat queued",
                        lambda: chat_waiting(browser), READ_S)
            assert now["nightly"] == "1 in flight, 0 queued", now
        assert b'"choices"' in chat.result(timeout=30)  # answered once the stream was left
    until("nothing in flight or queued", lambda: set(requests_of(browser).values())
          == {"0 in flight, 0 queued"}, READ_S)
    assert console_errors(browser) == []


def chat_waiting(browser: Any) -> dict[str, str]:
    shown = requests_of(browser)
    assert shown["chat"] == "0 in flight, 1 queued", shown
    return shown


# Run before the page's own scripts: the statuses of the page's reads of /api/keys and
# /api/devices, each counted once the page took its answer (in a task of its own, after the
# page's handling of the body, a refusal's included).
COUNT_READS = """
(() => {
  window.reads = { "/api/keys": [], "/api/devices": [] };
  const realFetch = window.fetch;
  window.fetch = async (input, init) => {
    const resp = await realFetch(input, init);
    const seen = window.reads[new URL(String(input), location.href).pathname];
    if (!seen) return resp;
    const body = await resp.json();
    const handed = new Response(null, { status: resp.status });
    handed.json = async () => { setTimeout(() => seen.push(resp.status)); return body; };
    return handed;
  };
})();
"""


def reads(browser: Any, path: str) -> list[int]:
    seen: list[int] = browser.execute_script("return window.reads[arguments[0]]", path)
    return seen


def test_a_page_key_without_the_admin_scope_sees_no_keys_section_and_no_warning(
    keyed: Hal0dPopen, browser: Any
) -> None:
    browser.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": COUNT_READS})
    open_with_key(browser, keyed, "viewer")
    until("the page's read of /api/keys, refused", lambda: reads(browser, "/api/keys") == [403],
          READ_S)
    devices = len(reads(browser, "/api/devices"))
    # Two more reads of the devices (5 s apart): a second read of the keys would have come.
    until("two more reads of /api/devices",
          lambda: len(reads(browser, "/api/devices")) >= devices + 2, READ_S)
    assert reads(browser, "/api/keys") == [403]  # not asked again
    assert panel(browser) is None
    assert browser.execute_script(
        "return document.querySelectorAll('#keys-section article').length") == 0
    assert not browser.find_element(By.ID, "notice").is_displayed()
    assert browser.find_element(By.ID, "live").is_displayed()
    body = browser.execute_script("return document.body.innerText")
    assert "403" not in body and "admin" not in body, body
    # The browser's own line for the refused read; nothing from the page's scripts.
    assert all("/api/keys" in line and "403" in line for line in console_errors(browser))


def test_a_hal0d_without_keys_shows_no_keys_section(tmp_path: Path, browser: Any) -> None:
    browser.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": COUNT_READS})
    with serving_text(tmp_path, lambda port: page_config_text(port, tmp_path, keys=False)) as it:
        assert json.loads(it.call("/api/keys"))["keys"] == []
        browser.get(it.url + "/")
        until("the page's read of /api/keys", lambda: reads(browser, "/api/keys") == [200],
              READ_S)
        assert panel(browser) is None
        assert console_errors(browser) == []
