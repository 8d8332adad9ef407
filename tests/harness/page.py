"""The status page's tests: Debian's chromium driven by selenium through chromium-driver, the
`hal0d serve` they point it at (its slots the stub, one of them on demand), and the two readers
(a slot card's state, the requests listed) that more than one of them reads the page with."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.harness.daemons import Hal0dPopen
from tests.harness.poll import eventually_sync
from tests.harness.ports import free_port

T = TypeVar("T")

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
PAGE_KEY = "page-test-key-0123456789"  # page_config_text's client key, with `keys`
# Also copied here when set (how docs/dashboard.png was made).
SHOTS = Path(os.environ["HAL0D_SCREENSHOTS"]) if os.environ.get("HAL0D_SCREENSHOTS") else None


def require_chromium() -> None:
    """Skips the calling test module where chromium, its driver or selenium is missing."""
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        pytest.skip("needs Debian's chromium and chromium-driver: `make test` as root installs "
                    "them (apt-get install chromium chromium-driver)", allow_module_level=True)
    pytest.importorskip("selenium.webdriver")


@contextlib.contextmanager
def open_browser() -> Iterator[Any]:
    """Headless chromium at 1440x900 that keeps the console's log, quit when the block ends."""
    from selenium import webdriver
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                     "--window-size=1440,900"):
        options.add_argument(argument)
    options.binary_location = CHROMIUM
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    try:
        driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    except WebDriverException as exc:
        pytest.fail(f"chromium did not start: {exc.msg}")
    try:
        yield driver
    finally:
        driver.quit()


def console_errors(browser: Any) -> list[str]:
    return [entry["message"] for entry in browser.get_log("browser")
            if entry["level"] == "SEVERE"]


def screenshot(browser: Any, folder: Path, width: int, height: int) -> Path:
    browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
        "width": width, "height": height, "deviceScaleFactor": 1, "mobile": width < 600})
    time.sleep(0.3)  # one layout pass at the new size before the picture
    path = folder / f"dashboard-{width}x{height}.png"
    browser.save_screenshot(str(path))
    if SHOTS is not None:
        SHOTS.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, SHOTS / path.name)
    return path


def page_daemon_text(port: int, tmp: Path, server_extra: str = "") -> str:
    """The [server], [metrics] and [logging] tables every page test's daemon shares (its history
    in `tmp`); `server_extra` lines join [server]."""
    return f"""
[server]
host = "127.0.0.1"
port = {port}
shutdown_grace_s = 1.0
{server_extra}
[metrics]
database = "{tmp / 'history.sqlite3'}"

[logging]
format = "json"
"""


def page_config_text(port: int, tmp: Path, *, keys: bool) -> str:
    """The page's daemon: the slot `llm` (the stub, always loaded) and the on-demand `ondemand`;
    with `keys`, PAGE_KEY its one client key."""
    stub = [sys.executable, "-m", "hal0d", "stub", "--delay", "0.005"]
    always_port, demand_port = free_port(), free_port()
    server_keys = f'api_keys = ["{PAGE_KEY}"]\n' if keys else ""
    return page_daemon_text(port, tmp, server_keys) + f"""
[[slots]]
name = "llm"
upstream = "http://127.0.0.1:{always_port}"
models = ["chat", "reasoning", "stall"]
command = {json.dumps([*stub, "--port", str(always_port), "--log", str(tmp / "llm.log")])}
stream_idle_timeout_s = 0.5

[[slots]]
name = "ondemand"
upstream = "http://127.0.0.1:{demand_port}"
models = ["think-only"]
command = {json.dumps([*stub, "--port", str(demand_port), "--log", str(tmp / "od.log")])}
start = "on_demand"
"""


def route_config_text(port: int, tmp_path: Path, gone: str, second: str, served: str) -> str:
    """page_config_text's with a slot `gone` at `gone` and the route `either` over it and
    `second` (asked for `served`)."""
    return page_config_text(port, tmp_path, keys=False) + f"""
[[slots]]
name = "gone"
upstream = "{gone}"
models = ["gone-only"]

[[routes]]
model = "either"
slots = ["gone", "{second}"]
served = {{ gone = "chat", {second} = "{served}" }}
"""


def until(what: str, check: Callable[[], T], timeout: float = 2.0) -> T:
    """The truthy value of `check` within `timeout` seconds (what the page promises): the one
    poller, told what it waits for first, as a page test reads."""
    return eventually_sync(check, timeout, what)


@contextlib.contextmanager
def serving_text(tmp: Path, text: Callable[[int], str]) -> Iterator[Hal0dPopen]:
    """`hal0d serve` on the config `text(port)` (its port picked here), stopped when the block
    ends."""
    port = free_port()
    config = tmp / "hal0d.toml"
    config.write_text(text(port))
    daemon = Hal0dPopen(port, config, tmp / "hal0d.out")
    daemon.start()
    try:
        yield daemon
    finally:
        daemon.stop()


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
