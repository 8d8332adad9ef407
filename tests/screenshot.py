"""`make screenshot`: docs/dashboard.png and docs/dashboard-390.png, the status page of the demo
`make run` serves, at 1440x900 and at a phone's 390x844; and docs/page-devices.png, the page of
a hal0d on a simulated box of two GPUs.

The demo runs as tests/demo.py runs it (etc/hal0d.toml, only hal0d's port and the stub's log
moved), gets a few of the requests the README's tour makes (a chat, a reasoning stream, a tool
call, a stream the stub cuts), and Debian's chromium, headless, photographs the page at
1440x900 and at 390x844 (as a phone: `mobile`, its own layout). So the pictures show the slot,
the models and the last hour a newcomer will see.

    python -m tests.screenshot [PATH]     (default: docs/dashboard.png)

The devices' picture (`--devices`) is of a hal0d on the simulated GPU box (tests/harness/
gpu_page.py): two 24 GiB GPUs, a desktop holding 2 GiB of the first, three stub slots loaded
one after another a few seconds apart, each onto the GPU its `devices` names, so each GPU's bar
shows its slots, other programs and free memory, and its line of free memory steps down.

    python -m tests.screenshot --devices [PATH]     (default: docs/page-devices.png)
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
from tests.harness.gpu_page import BoxSlot, gpu_page_daemon, make_gpu_box

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
WIDTH, HEIGHT = 1440, 900
PHONE = (390, 844)
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


# The devices' picture: what each slot takes, on which GPU, loaded in this order.
BOX_SLOTS = (BoxSlot("coder", "qwen2.5-coder-32b", 18944, device=0),
             BoxSlot("chat", "gemma-3-12b", 9830, device=1),
             BoxSlot("embed", "nomic-embed-text", 1126, device=1))
GIB = 1024


def load_slot(url: str, name: str) -> None:
    request = urllib.request.Request(f"{url}/api/slots/{name}/load", method="POST")
    with urllib.request.urlopen(request, timeout=60) as resp:  # answers once it is ready
        resp.read()


def device_parts(browser: Any) -> int:
    count: int = browser.execute_script(
        "return document.querySelectorAll('#devices-section .device-bar .part.slot').length;")
    return count


def read_at(browser: Any) -> str:
    text: str = browser.execute_script(
        "return document.querySelector('#devices-section .device-source').textContent;")
    return text


def make_devices(path: Path, pace_s: float = 6.0) -> Path:
    """The page of a hal0d on two simulated 24 GiB GPUs, its slots loaded `pace_s` apart (the
    free memory's line steps down between them), photographed into `path` at 1440x900."""
    with tempfile.TemporaryDirectory(prefix="hal0d-screenshot-") as tmp:
        box = Path(tmp) / "box.json"
        make_gpu_box(box, [24 * GIB, 24 * GIB], desktop={0: 2 * GIB})
        with gpu_page_daemon(Path(tmp), box, BOX_SLOTS, start="on_demand") as daemon:
            browser = chromium()
            try:
                browser.get(daemon.url + "/")
                until("the devices", lambda: browser.execute_script(
                    "return document.querySelectorAll('#devices-section article').length") == 2)
                for slot in BOX_SLOTS:
                    time.sleep(pace_s)  # a step in the line of free memory per load
                    load_slot(daemon.url, slot.name)
                until("every slot's part of its GPU",
                      lambda: device_parts(browser) == len(BOX_SLOTS))
                drawn = read_at(browser)
                time.sleep(pace_s)  # the line after the last step
                until("a read after the last step", lambda: read_at(browser) != drawn)
                browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
                    "width": WIDTH, "height": HEIGHT, "deviceScaleFactor": 1, "mobile": False})
                until("the page at its size", lambda: browser.execute_script(
                    "return window.innerHeight") == HEIGHT)
                path.parent.mkdir(parents=True, exist_ok=True)
                browser.save_screenshot(str(path))
            finally:
                browser.quit()
    return path


def phone_path(path: Path) -> Path:
    return path.with_name(f"{path.stem}-{PHONE[0]}{path.suffix}")


def chromium() -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                     f"--window-size={WIDTH},{HEIGHT}", "--hide-scrollbars"):
        options.add_argument(argument)
    options.binary_location = CHROMIUM
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def make(path: Path) -> list[Path]:
    """The page of a freshly started demo, photographed into `path` and, at phone width, into
    `phone_path(path)`."""
    with tempfile.TemporaryDirectory(prefix="hal0d-screenshot-") as tmp, \
            running_demo(Path(tmp)) as demo:
        browser = chromium()
        try:
            browser.get(f"http://127.0.0.1:{demo.port}/")
            until("the demo's slot ready", lambda: browser.execute_script(
                "const c = document.querySelector('article.card[data-slot=\"llm\"]');"
                "return c && c.getAttribute('data-state') === 'ready';"))
            for model, stream in REQUESTS:
                ask(demo, model, stream)
            until("every request", lambda: rows(browser) >= len(REQUESTS))
            until("the last hour's charts", lambda: browser.execute_script(
                "return document.querySelectorAll('#charts circle.point').length > 0;"))
            path.parent.mkdir(parents=True, exist_ok=True)
            for (width, height), where in (((WIDTH, HEIGHT), path), (PHONE, phone_path(path))):
                browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
                    "width": width, "height": height, "deviceScaleFactor": 1,
                    "mobile": width < 600})
                time.sleep(1.5)  # the ages, the TTFT figures and the charts, redrawn at this size
                browser.save_screenshot(str(where))
        finally:
            browser.quit()
    return [path, phone_path(path)]


def main(argv: list[str]) -> int:
    if argv[:1] == ["--devices"]:
        made = [make_devices(Path(argv[1]) if argv[1:] else REPO / "docs" / "page-devices.png")]
    else:
        made = make(Path(argv[0]) if argv else REPO / "docs" / "dashboard.png")
    for path in made:
        print(f"screenshot: {path} ({path.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
