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

The keys' picture (`--keys`) is of the family box of docs/shares.md: a chat of weight 2, a coding
agent with a day's quota, a nightly batch job, the kids' helper with an hour's quota, Home
Assistant without a key, and the operator's key, whose page it is. For KEYS_TRAFFIC_S each sends
what it would (the batch job without a pause, the agent's long prompts from its second minute,
the chat in two bursts, the kids until their hour is used up) to one stub slot that answers two
at a time, and the Keys section is photographed while work still waits in its queue.

    python -m tests.screenshot --keys [PATH]     (default: docs/page-keys.png)
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.demo import REPO, RunningDemo, running_demo
from tests.harness.gpu_page import BoxSlot, gpu_page_daemon, make_gpu_box
from tests.harness.page import page_daemon_text, serving_text
from tests.harness.ports import free_port

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


# The keys' picture: who asks for what, and when (seconds from the start of the traffic).
KEYS_TRAFFIC_S = 150.0


@dataclass(frozen=True)
class Client:
    key: str | None  # its [[keys]] table's name; None: Home Assistant, which sends no key
    words: int  # its prompt's length
    max_tokens: int
    pause_s: float  # between two of its requests
    active: tuple[tuple[float, float], ...] = ((0.0, KEYS_TRAFFIC_S),)


FAMILY = (Client("chat", 40, 120, 2.0, ((0.0, 45.0), (95.0, KEYS_TRAFFIC_S))),
          Client("agent", 600, 250, 0.5, ((40.0, KEYS_TRAFFIC_S),)),
          Client("nightly", 80, 200, 0.0), Client("nightly", 80, 200, 0.0),
          Client("kids", 30, 200, 6.0), Client(None, 10, 40, 15.0))
FAMILY_KEYS = """
[[keys]]
name = "chat"
key = "sk-shot-chat"
scopes = ["inference"]
weight = 2

[[keys]]
name = "agent"
key = "sk-shot-agent"
scopes = ["inference"]
tokens_per_day = 100_000

[[keys]]
name = "nightly"
key = "sk-shot-nightly"
scopes = ["inference"]
class = "batch"

[[keys]]
name = "kids"
key = "sk-shot-kids"
scopes = ["inference"]
tokens_per_hour = 2_000
tokens_per_day = 10_000

[[keys]]
name = "admin"
key = "sk-shot-admin"
scopes = ["read", "admin"]
"""


def family_config_text(port: int, tmp: Path) -> str:
    upstream = free_port()
    stub = [sys.executable, "-m", "hal0d", "stub", "--delay", "0.005", "--port", str(upstream),
            "--log", str(tmp / "llm.log")]
    return page_daemon_text(port, tmp, 'anonymous = { scopes = ["inference"] }\n') + f"""
[[slots]]
name = "llm"
upstream = "http://127.0.0.1:{upstream}"
models = ["reasoning"]
command = {json.dumps(stub)}
max_concurrent = 2
queue_timeout_s = 120
""" + FAMILY_KEYS


def send(url: str, client: Client) -> None:
    # "long" as the last message: the stub answers until max_tokens.
    body = json.dumps({"model": "reasoning", "stream": True, "max_tokens": client.max_tokens,
                       "messages": [{"role": "system", "content": "word " * client.words},
                                    {"role": "user", "content": "long"}]}).encode()
    headers = {"Content-Type": "application/json"}
    if client.key:
        headers["Authorization"] = f"Bearer sk-shot-{client.key}"
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=180) as resp:
            resp.read()
    except (urllib.error.URLError, OSError):
        pass  # the kids' 429 once their hour is used up: a row of the picture, as it would be


def traffic(url: str, client: Client, started: float, stop: threading.Event) -> None:
    while not stop.is_set():
        elapsed = time.monotonic() - started
        if any(begin <= elapsed < end for begin, end in client.active):
            send(url, client)
            stop.wait(client.pause_s)
        else:
            stop.wait(1.0)


def queued_cards(browser: Any) -> int:
    count: int = browser.execute_script(
        "return [...document.querySelectorAll('#keys-section dd')]"
        ".filter((dd) => / [1-9][0-9]* queued$/.test(dd.textContent)).length;")
    return count


def make_keys(path: Path, traffic_s: float = KEYS_TRAFFIC_S) -> Path:
    """The Keys section of the family box's page after `traffic_s` of its traffic, photographed
    into `path` at 1440x900 while work waits in the queue."""
    with tempfile.TemporaryDirectory(prefix="hal0d-screenshot-") as tmp, \
            serving_text(Path(tmp), lambda port: family_config_text(port, Path(tmp))) as daemon:
        browser = chromium()
        stop = threading.Event()
        started = time.monotonic()
        clients = [threading.Thread(target=traffic, args=(daemon.url, client, started, stop))
                   for client in FAMILY]
        try:
            browser.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {
                "source": "localStorage.setItem('hal0d.api_key', 'sk-shot-admin');"})
            browser.get(daemon.url + "/")
            until("the keys", lambda: browser.execute_script(
                "return document.querySelectorAll('#keys-section article').length") == 6)
            for client in clients:
                client.start()
            stop.wait(traffic_s)
            until("work waiting in the queue", lambda: queued_cards(browser) > 0)
            browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
                "width": WIDTH, "height": HEIGHT, "deviceScaleFactor": 1, "mobile": False})
            until("the page at its size", lambda: browser.execute_script(
                "return window.innerHeight") == HEIGHT)
            # The section at the top, its title clear of the edge (the slot's card is above).
            browser.execute_script("const top = document.getElementById('keys-section')"
                                   ".getBoundingClientRect().top; window.scrollBy(0, top - 16);")
            path.parent.mkdir(parents=True, exist_ok=True)
            browser.save_screenshot(str(path))
        finally:
            stop.set()
            browser.quit()
            for client in clients:
                if client.is_alive():
                    client.join()
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
    elif argv[:1] == ["--keys"]:
        made = [make_keys(Path(argv[1]) if argv[1:] else REPO / "docs" / "page-keys.png")]
    else:
        made = make(Path(argv[0]) if argv else REPO / "docs" / "dashboard.png")
    for path in made:
        print(f"screenshot: {path} ({path.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
