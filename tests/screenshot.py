"""`make screenshot`: docs/dashboard.png, the status page of the demo `make run` serves.

The demo runs as tests/demo.py runs it (etc/hal0d.toml, only hal0d's port and the stub's log
moved), gets a few of the requests the README's tour makes (a chat, a reasoning stream, a tool
call, a stream the stub cuts), and Debian's chromium, headless, photographs the page at
1440x900. So the picture shows the slot and the models a newcomer will see.

    python -m tests.screenshot [PATH]     (default: docs/dashboard.png)
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tests.demo import REPO, RunningDemo, running_demo

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
WIDTH, HEIGHT = 1440, 900
# The tour's requests: streamed and not, reasoning, a tool call, and one failure (`broken`).
REQUESTS: tuple[tuple[str, bool], ...] = (
    ("chat", False), ("reasoning", True), ("tool", False), ("chat", True), ("broken", True),
    ("think-only", True),
)


def ask(demo: RunningDemo, model: str, stream: bool) -> None:
    body = json.dumps({"model": model, "stream": stream,
                       "messages": [{"role": "user", "content": "What is 17 * 23?"}]})
    request = urllib.request.Request(
        f"http://127.0.0.1:{demo.port}/v1/chat/completions", data=body.encode(),
        headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            resp.read()
    except (urllib.error.URLError, OSError):
        pass  # `broken` is cut mid-stream on purpose: its row is the picture's one failure


def rows(browser: Any) -> int:
    count: int = browser.execute_script(
        "return document.querySelectorAll('#requests tbody tr').length;")
    return count


def until(what: str, check: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"screenshot: the page did not show {what} within {timeout:g} s")
        time.sleep(0.1)


def make(path: Path) -> Path:
    """The page of a freshly started demo, photographed into `path`."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                     f"--window-size={WIDTH},{HEIGHT}", "--hide-scrollbars"):
        options.add_argument(argument)
    options.binary_location = CHROMIUM
    with tempfile.TemporaryDirectory(prefix="hal0d-screenshot-") as tmp, \
            running_demo(Path(tmp)) as demo:
        browser = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
        try:
            browser.get(f"http://127.0.0.1:{demo.port}/")
            until("the demo's slot ready", lambda: browser.execute_script(
                "const c = document.querySelector('article.card[data-slot=\"llm\"]');"
                "return c && c.getAttribute('data-state') === 'ready';"))
            for model, stream in REQUESTS:
                ask(demo, model, stream)
            until("every request", lambda: rows(browser) >= len(REQUESTS))
            browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
                "width": WIDTH, "height": HEIGHT, "deviceScaleFactor": 1, "mobile": False})
            time.sleep(1.5)  # the ages and the TTFT figures, redrawn once at this size
            path.parent.mkdir(parents=True, exist_ok=True)
            browser.save_screenshot(str(path))
        finally:
            browser.quit()
    return path


def main(argv: list[str]) -> int:
    path = Path(argv[0]) if argv else REPO / "docs" / "dashboard.png"
    made = make(path)
    print(f"screenshot: {made} ({made.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
