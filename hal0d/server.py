"""The server's life: listen, tell systemd, keep the watchdog fed, reload, drain, stop."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

from aiohttp import web

from hal0d import logs, systemd
from hal0d.app import make_app
from hal0d.appkeys import SLOTS
from hal0d.config import Config

log = logs.get_logger()


def serve(config: Config, config_path: Path) -> int:
    logs.configure(config.logging.level, config.logging.format)
    return asyncio.run(run(config, config_path))


def status_line(app: web.Application, config: Config) -> str:
    states = ", ".join(f"{s.name}={s.state}" for s in app[SLOTS])
    return f"listening on {config.server.host}:{config.server.port}; slots: {states or 'none'}"


async def watchdog(interval: float) -> None:
    # Pinged from the event loop itself: a blocked loop stops the pings and systemd restarts us.
    while True:
        systemd.notify("WATCHDOG=1")
        await asyncio.sleep(interval)


async def run(config: Config, config_path: Path) -> int:
    app = make_app(config)
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=config.server.shutdown_grace_s,
    )
    await runner.setup()
    site = web.TCPSite(runner, config.server.host, config.server.port, reuse_address=True)
    try:
        await site.start()
    except OSError as exc:
        log.error("server.bind_failed", host=config.server.host, port=config.server.port,
                  error=exc.strerror or str(exc))
        await runner.cleanup()
        return 1
    log.info("server.started", host=config.server.host, port=config.server.port,
             config=str(config_path))
    systemd.notify("READY=1", "STATUS=" + status_line(app, config))

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    tasks = []
    interval = systemd.watchdog_interval()
    if interval:
        tasks.append(asyncio.create_task(watchdog(interval)))
    await stop.wait()
    log.info("server.stopping")
    systemd.notify("STOPPING=1", "STATUS=draining")
    for task in tasks:
        task.cancel()
    await runner.cleanup()
    log.info("server.stopped")
    return 0
