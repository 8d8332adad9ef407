"""A slot's card on the status page in Debian's chromium (tests/test_page.py's browser) for its
prompt cache: the share of its prompt tokens the upstream took from its cache (llama-server's
captured answer), the conversations kept warm and the cache saved and restored, as a hal0d that
keeps prompt caches shows them, and neither line for a slot whose view has neither field."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.harness.daemons import Hal0dPopen
from tests.harness.page import (
    card_state,
    console_errors,
    page_config_text,
    require_chromium,
    screenshot,
    until,
)
from tests.harness.ports import free_port

require_chromium()


# Run before the page's own scripts: /api/slots and the event feed's slot views as a hal0d that
# keeps prompt caches shows them (conversations_warm, prompt_cache) for the slot "warm", and as
# one that does not (neither field) for "llm", whichever this hal0d is.
WITH_CACHE_FIELDS = """
(() => {
  const SAVED = %(saved)s;
  const shown = (view) => {
    if (view.name === "warm") {
      Object.assign(view, { conversations_warm: 2, prompt_cache: { saved_at: SAVED,
        saved_tokens: 903, restored_at: SAVED + 60, restored_tokens: 903, failures: 0 } });
    } else {
      delete view.conversations_warm;
      delete view.prompt_cache;
    }
  };
  const views = (data) => { (data.slots || []).forEach(shown); if (data.view) shown(data.view);
    return data; };
  const realFetch = window.fetch;
  window.fetch = async (input, init) => {
    const resp = await realFetch(input, init);
    const path = new URL(String(input), location.href).pathname;
    if (path === "/api/slots") {
      return new Response(JSON.stringify(views(await resp.json())), { status: resp.status });
    }
    if (path !== "/api/events" || !resp.body) return resp;
    let buffer = "";
    const frames = new TransformStream({ transform(text, out) {
      const parts = (buffer + text).split("\\n\\n");
      buffer = parts.pop();
      for (const frame of parts) {
        const lines = frame.split("\\n");
        const at = lines.findIndex((line) => line.startsWith("data: "));
        if (at >= 0 && /^event: (hello|slot)$/m.test(frame)) {
          lines[at] = "data: " + JSON.stringify(views(JSON.parse(lines[at].slice(6))));
        }
        out.enqueue(lines.join("\\n") + "\\n\\n");
      }
    } });
    return new Response(resp.body.pipeThrough(new TextDecoderStream()).pipeThrough(frames)
      .pipeThrough(new TextEncoderStream()), { status: resp.status, headers: resp.headers });
  };
})();
"""


@contextlib.contextmanager
def llama_server_capture() -> Iterator[str]:
    """An upstream on a real port that answers every chat completion with llama-server's
    captured answer tests/fixtures/llama-server/chat-warm.json (903 of its 917 prompt tokens
    taken from the cache)."""
    import http.server
    import threading

    from tests.fixtures_util import fixture_path

    answer = fixture_path("llama-server/chat-warm.json").read_bytes()

    class Handler(http.server.BaseHTTPRequestHandler):
        def reply(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            self.reply(200, b'{"object":"list","data":[]}')

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            found = self.path == "/v1/chat/completions"
            self.reply(200 if found else 404, answer if found else b"{}")

        def log_message(self, *_: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def card_facts(browser: Any, slot: str) -> dict[str, str]:
    facts: dict[str, str] = browser.execute_script(
        "const card = document.querySelector(`article.card[data-slot=\"${arguments[0]}\"]`);"
        "if (!card) return {}; const out = {};"
        "card.querySelectorAll('dt').forEach(dt => { out[dt.textContent] ="
        " dt.nextElementSibling.textContent; }); return out;", slot)
    return facts


def test_a_slots_card_shows_the_cached_share_of_its_prompts_and_its_saved_cache(
    tmp_path: Path, browser: Any
) -> None:
    port = free_port()
    config = tmp_path / "hal0d.toml"
    saved = time.time() - 120
    with llama_server_capture() as upstream:
        config.write_text(page_config_text(port, tmp_path, keys=False) + f"""
[[slots]]
name = "warm"
upstream = "{upstream}"
models = ["smol"]
""")
        daemon = Hal0dPopen(port, config, tmp_path / "hal0d.out")
        daemon.start()
        try:
            browser.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument",
                                    {"source": WITH_CACHE_FIELDS % {"saved": saved}})
            browser.get(daemon.url + "/")
            until("the warm slot ready", lambda: card_state(browser, "warm") == "ready", 20)
            until("the llm slot ready", lambda: card_state(browser, "llm") == "ready", 20)
            assert "cache" not in card_facts(browser, "warm")  # nothing asked of it yet
            for _ in range(2):
                daemon.call("/v1/chat/completions", {"model": "smol", "messages": [
                    {"role": "user", "content": "hi"}]})
            daemon.call("/v1/chat/completions", {"model": "chat", "messages": [
                {"role": "user", "content": "hi"}]})
            facts = until("the cached share", lambda: "cache" in card_facts(browser, "warm")
                          and card_facts(browser, "warm"), 5)
            assert facts["cache"] == "98 % of prompt tokens"  # 2 x 903 of 2 x 917
            title = browser.execute_script(
                "return [...document.querySelectorAll('article.card[data-slot=\"warm\"] dt')]"
                ".find(dt => dt.textContent === 'cache').nextElementSibling.firstChild.title;")
            assert title.startswith("1806 of 1834 prompt tokens"), title
            assert facts["warm"] == "2 conversations"
            at = [time.strftime("%H:%M:%S", time.localtime(saved + s)) for s in (0, 60)]
            assert facts["saved cache"] == f"saved 903 tokens at {at[0]}, restored 903 at {at[1]}"
            # A slot whose view has neither field (a hal0d from before them): neither line.
            plain = card_facts(browser, "llm")
            assert {"warm", "saved cache"} & set(plain) == set(), plain
            assert console_errors(browser) == []
            screenshot(browser, tmp_path, 1440, 900)
            browser.execute_script(
                "document.querySelector('article.card[data-slot=\"warm\"]').scrollIntoView();")
            screenshot(browser, tmp_path, 390, 844)
        finally:
            daemon.stop()
