"""`python -m bench --profile`: py-spy records this tree's hal0d under four loads once the
sections are done, and leaves flame graphs and collapsed stacks in bench/results/ (bench/hot.py
reads the latter). No rows: the files are for a reader looking for where hal0d's time goes.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from bench import client, procs
from bench.client import CHAT, MESSAGES, Endpoint, chat_body, messages_body
from bench.runs import RESULTS, Run, say


async def profile_section(run: Run, hal0d: procs.Child) -> None:
    """py-spy on hal0d under four loads: the single unpaced stream (profile.svg), paced streams
    through /v1 and /llm/v1/messages (one event per read: the per-event path), and sequential
    non-streaming requests (the per-request path). Flame graphs (.svg) and collapsed stacks
    (.txt, for grep and `bench.hot`) land in bench/results/."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not os.path.exists(spy):  # noqa: ASYNC240
        run.skipped["profile"] = "py-spy not installed (pip install py-spy)"
        return
    n = run.plan.single_chunks
    paced = run.plan.paced_chunks
    RESULTS.mkdir(parents=True, exist_ok=True)
    duration = 8

    async def single(s: aiohttp.ClientSession) -> None:
        await client.read_stream(Endpoint("hal0d", s, hal0d.base + CHAT,
                                          chat_body(stream=True, tokens=n), client.JSON_HEADERS))

    async def paced_chat(s: aiohttp.ClientSession) -> None:
        ep = Endpoint("hal0d", s, hal0d.base + CHAT,
                      chat_body(stream=True, tokens=paced, model="paced-20"), client.JSON_HEADERS)
        await asyncio.gather(*(client.read_stream(ep) for _ in range(run.plan.paced_streams)))

    async def paced_messages(s: aiohttp.ClientSession) -> None:
        ep = Endpoint("hal0d", s, hal0d.base + MESSAGES,
                      messages_body(tokens=paced, model="paced-20"), client.ANTHROPIC_HEADERS,
                      end_marker=b"message_stop")
        await asyncio.gather(*(client.read_stream(ep) for _ in range(run.plan.paced_streams)))

    async def requests(s: aiohttp.ClientSession) -> None:
        ep = Endpoint("hal0d", s, hal0d.base + CHAT, chat_body(stream=False),
                      client.JSON_HEADERS)
        for _ in range(200):
            await client.request_time(ep)

    jobs = (("profile", single), ("profile-paced", paced_chat),
            ("profile-paced-messages", paced_messages), ("profile-requests", requests))
    async with client.session() as s:
        for name, load in jobs:
            outputs = {"flamegraph": RESULTS / f"{name}.svg", "raw": RESULTS / f"{name}.txt"}
            spies = [
                subprocess.Popen(  # noqa: ASYNC220
                    [spy, "record", "--pid", str(hal0d.pid), "--rate", "250", "--duration",
                     str(duration), "--format", fmt, "--nonblocking", "-o", str(out)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                for fmt, out in outputs.items()
            ]
            await asyncio.sleep(1.0)
            deadline = time.monotonic() + duration - 1.5
            count = 0
            while time.monotonic() < deadline:
                await load(s)
                count += 1
            for p in spies:
                p.wait(timeout=duration + 30)
            say(f"profile: {name}: {count} loads, {outputs['flamegraph']}")
            run.results.setdefault("profiles", {})[name] = {
                fmt: str(out.relative_to(procs.ROOT)) for fmt, out in outputs.items()
                if out.exists()}
