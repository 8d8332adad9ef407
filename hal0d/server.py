"""The server's life: listen, tell systemd, keep the watchdog fed, reload, drain, stop.

Start: the soft open-files limit goes up to the hard one (descriptors.py: two sockets a stream);
the cleanup contexts open the upstream session and the history, launch the slot processes and
probe every other slot; then hal0d listens, with `[server].backlog` as listen(2)'s queue (the
kernel clips it to net.core.somaxconn, and the log says when), and sends READY=1 with a STATUS
line. With `[ollama] listen` set, the same application also listens there (a second site of
the one runner: one lifecycle, one drain), and answers the Ollama API on that port.

Stop (SIGTERM, SIGINT), in this order:

1. STOPPING=1. The listening socket closes at once; idle keep-alive connections are closed and
   busy ones close after their current response, so no new request gets in.
2. In-flight requests get `[server].shutdown_grace_s` to finish on their own.
3. Then every stream still open is ended with its surface's terminal frame
   (`StallGuard.end_now("shutdown")`: the stall-guard frame on OpenAI SSE, `event: error` on the
   Anthropic surface). A stream that starts after that (its request was waiting for headers) is
   ended the same way, and requests still queued for a slot get a 503: the slots go offline.
4. TERMINAL_FRAME_S later aiohttp cancels whatever still runs; the cleanup contexts stop the
   slot processes, flush the request history and close the session. Exit code 0.

aiohttp's own shutdown timeout cancels handlers without a word to their clients, so step 3 is
ours and comes first: aiohttp's timeout is the grace plus TERMINAL_FRAME_S. A second signal skips
what is left of the grace.

Reload (SIGHUP): RELOADING=1, then the config file is read and validated again. Invalid: hal0d
keeps running on the old one and logs each problem (`config.reload_problem problem=...`, one line
each), then `config.reload_failed problems=N`. Valid: slot
changes are applied (LifecycleManager.apply), then app[RUNTIME] points at a new Runtime, which new
requests use; in-flight ones keep the one they started with. READY=1 either way. The keys in
RESTART_KEYS only take effect at start: they keep their running values and a warning says so.
`serve --host/--port` override [server] for the whole run: a reload applies them to the reloaded
file too, so a file that differs from the flags is no restart to warn about.

A listening address that cannot be had (taken, privileged, not this machine's) is
`server.bind_failed` with a hint naming the flag or key to change, and exit code 1.
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import uvloop
from aiohttp import web

from hal0d import config as configuration
from hal0d import library, logs, preflight, systemd
from hal0d.app import make_app
from hal0d.appkeys import (
    DEVICES,
    DISPATCH,
    HEADS,
    LIFECYCLE,
    RESCAN,
    RUNTIME,
    SHARE_BOOK,
    SLOTS,
)
from hal0d.config import Config
from hal0d.front.listeners import close_all, somaxconn, take_sockets
from hal0d.lifecycle.reload import ConfigDiff
from hal0d.observability.history import HistoryInUse
from hal0d.preflight import Finding
from hal0d.routing import Runtime
from hal0d.transport import descriptors
from hal0d.transport.stallguard import StallGuard

log = logs.get_logger()

# After the grace: how long the ended streams get to write their terminal frames.
TERMINAL_FRAME_S = 2.0
# How often, once the grace is over, newly started streams are looked for and ended.
END_POLL_S = 0.05
STATUS_EVERY_S = 5.0
# A reload waits this long for the leases on a replaced slot process when the stall guard's
# total bound is off (0), before stopping that process anyway.
DRAIN_UNBOUNDED_S = 900.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

# (section, key) read once at start; a reload keeps their running values.
RESTART_KEYS: tuple[tuple[str, str], ...] = (
    ("server", "host"),
    ("server", "port"),
    ("server", "backlog"),  # the listening socket's, set once by listen(2)
    ("server", "max_body_bytes"),  # the application's client_max_size
    ("server", "shutdown_grace_s"),  # aiohttp's shutdown timeout is fixed with its runner
    ("server", "keepalive_timeout_s"),  # so is its keep-alive timeout
    ("ollama", "listen"),  # the Ollama listener's socket, taken once like [server]'s
    ("metrics", "database"),  # the history writer opens its file once
    ("metrics", "retention_days"),
    ("metrics", "ttft_samples"),
)


def serve(
    config: Config,
    config_path: Path,
    *,
    server_overrides: Mapping[str, Any] | None = None,
    warnings: Sequence[Finding] = (),
) -> int:
    """Run until stopped. `server_overrides`: [server] keys given on the command line, and
    `ollama_listen`, [ollama].listen as --ollama-port made it."""
    logs.configure(config.logging.level, config.logging.format, cache_loggers=True)
    logs.hide(known_secrets(config))
    log_warnings(warnings, config_path)
    raise_open_files_limit()
    # uvloop: about a tenth less CPU per request and per relayed chunk than asyncio's own loop
    # (make bench), the same semantics; the served tests run the daemon this way too.
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(run(config, config_path, server_overrides or {}))


def log_warnings(warnings: Sequence[Finding], config_path: Path) -> None:
    for warning in warnings:
        log.warning("config.warning", config=str(config_path), key=warning.key,
                    problem=warning.problem)


def log_reload_failed(config_path: Path, problems: Sequence[str]) -> None:
    """A refused reload: a line per problem, as check-config prints them (a list in one field
    would be a Python repr on a key=value or journald line), then the refusal with their count,
    the line that ends the story."""
    for problem in problems:
        log.error("config.reload_problem", config=str(config_path), problem=problem)
    log.error("config.reload_failed", config=str(config_path), problems=len(problems),
              keeping="the running configuration")


async def run(config: Config, config_path: Path,
              server_overrides: Mapping[str, Any] | None = None) -> int:
    return await Daemon(config, config_path, server_overrides).run()


def with_server_overrides(config: Config, overrides: Mapping[str, Any]) -> Config:
    if not overrides:
        return config
    server = {key: value for key, value in overrides.items() if key != "ollama_listen"}
    config = dataclasses.replace(config, server=dataclasses.replace(config.server, **server))
    if (listen := overrides.get("ollama_listen")) is not None and config.ollama.listen:
        config = dataclasses.replace(config, ollama=dataclasses.replace(config.ollama,
                                                                        listen=listen))
    return config


def raise_open_files_limit() -> None:
    raised = descriptors.raise_open_files_limit()
    if raised is not None:
        old, new, hard = raised
        log.info("server.fd_limit_raised", soft=old, new=new, hard=hard)


def known_secrets(config: Config) -> list[str]:
    """The client keys hal0d accepts and the slots' upstream keys: no log line may show them,
    whatever carries them there."""
    upstream = [token for slot in config.slots if (token := slot.bearer_token())]
    return [*config.server.accepted_keys, *(key.secret for key in config.keys), *upstream]


def restart_needed(running: Config, loaded: Config) -> list[str]:
    return [
        f"{section}.{key}"
        for section, key in RESTART_KEYS
        if getattr(getattr(running, section), key) != getattr(getattr(loaded, section), key)
    ]


def keep_restart_keys(running: Config, loaded: Config) -> Config:
    """`loaded` with the running values of RESTART_KEYS, so the Runtime tells the truth."""
    for section, key in RESTART_KEYS:
        table: Any = dataclasses.replace(
            getattr(loaded, section), **{key: getattr(getattr(running, section), key)}
        )
        loaded = dataclasses.replace(loaded, **{section: table})
    return loaded


def drain_time(running: Config) -> float:
    """How long a reload waits for a replaced slot's in-flight requests: the longest a request
    may run on the running settings, over every slot's own bounds."""
    bounds = [slot.timeouts(running.dispatcher) for slot in running.slots] or [running.dispatcher]
    return max(
        max(timeouts.stream_total_timeout_s, timeouts.direct_read_timeout_s)
        if timeouts.stream_total_timeout_s > 0 else DRAIN_UNBOUNDED_S
        for timeouts in bounds
    )


async def watchdog(interval: float) -> None:
    # Pinged from the event loop itself: a blocked loop stops the pings and systemd restarts us.
    while True:
        systemd.notify("WATCHDOG=1")
        await asyncio.sleep(interval)


class Daemon:
    """One run of `hal0d serve`: the application, its runner and the signals that steer them."""

    def __init__(self, config: Config, config_path: Path,
                 server_overrides: Mapping[str, Any] | None = None) -> None:
        self.config_path = config_path
        self.server_overrides = dict(server_overrides or {})
        config = with_server_overrides(config, self.server_overrides)
        self.app = make_app(config)
        self.grace_s = config.server.shutdown_grace_s
        self.runner = web.AppRunner(
            self.app,
            handler_cancellation=True,
            access_log=None,  # request.done is the access log
            shutdown_timeout=self.grace_s + TERMINAL_FRAME_S,
            keepalive_timeout=config.server.keepalive_timeout_s,
        )
        self.address = f"{config.server.host}:{config.server.port}"
        if config.ollama.listen is not None:
            self.address += f" (Ollama API on {config.ollama.listen})"
        self.stop_signals = 0
        self.stop_requested = asyncio.Event()
        self.grace_cut_short = asyncio.Event()
        self.reload_requested = asyncio.Event()
        self.reloading = False
        # Set once each reload is done, then replaced: a rescan waits on it (rescan()).
        self.reload_done = asyncio.Event()
        self.app[RESCAN] = self.rescan

    @property
    def config(self) -> Config:
        return self.app[RUNTIME].current.config

    def status(self) -> str:
        states = ", ".join(f"{slot.name}={slot.state}" for slot in self.app[SLOTS])
        return f"listening on {self.address}; slots: {states or 'none'}"

    def on_stop_signal(self, signum: int) -> None:
        self.stop_signals += 1
        name = signal.Signals(signum).name
        if self.stop_signals == 1:
            log.info("server.stop_requested", signal=name)
            self.stop_requested.set()
        else:
            log.warning("server.grace_cut_short", signal=name)
            self.grace_cut_short.set()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        # Installed before anything slow: a SIGTERM or SIGHUP during the first probes must not
        # kill the process with the default action.
        for signum in STOP_SIGNALS:
            loop.add_signal_handler(signum, self.on_stop_signal, signum)
        loop.add_signal_handler(signal.SIGHUP, self.reload_requested.set)
        try:
            return await self.serve()
        finally:
            for signum in (*STOP_SIGNALS, signal.SIGHUP):
                loop.remove_signal_handler(signum)

    async def serve(self) -> int:
        config = self.config
        backlog = config.server.backlog
        ceiling = somaxconn()
        if ceiling is not None and backlog > ceiling:
            log.warning("server.backlog_clipped", requested=backlog, somaxconn=ceiling,
                        hint="raise net.core.somaxconn (sysctl) for a longer accept queue")
        sockets = take_sockets(config, backlog)
        if sockets is None:
            return 1
        try:
            await self.runner.setup()
        except HistoryInUse as exc:
            log.error("server.start_failed", config=str(self.config_path), error=str(exc))
            await self.runner.cleanup()
            close_all(sockets)
            return 1
        except Exception as exc:
            log.exception("server.start_failed", config=str(self.config_path),
                          error=f"{type(exc).__name__}: {exc}")
            await self.runner.cleanup()
            close_all(sockets)
            return 1
        if self.stop_requested.is_set():
            await self.runner.cleanup()
            close_all(sockets)
            return 0
        for sock in sockets:
            await web.SockSite(self.runner, sock, backlog=backlog).start()
        log.info("server.started", host=config.server.host, port=config.server.port,
                 config=str(self.config_path), slots=len(config.slots),
                 ollama=config.ollama.listen)
        systemd.ready(self.status())

        reloads = asyncio.create_task(self.reloads())
        server = self.runner.server
        assert server is not None  # set up above
        heads = asyncio.create_task(self.app[HEADS].run(lambda: server.connections))
        tasks = [reloads, heads, asyncio.create_task(self.keep_status())]
        interval = systemd.watchdog_interval()
        if interval:
            tasks.append(asyncio.create_task(watchdog(interval)))
        try:
            await self.stop_requested.wait()
            reloads.cancel()  # a stop wins over a reload in progress
            await self.shutdown()
        finally:
            # The watchdog is fed through the whole drain: a long grace must not look like a hang.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return 0

    async def shutdown(self) -> None:
        streams = self.app[DISPATCH].streams
        log.info("server.stopping", grace_s=self.grace_s, streams=len(streams))
        systemd.stopping(
            f"stopping: {len(streams)} streams get up to {self.grace_s:g} s to finish"
        )
        ender = asyncio.create_task(self.end_streams_after_grace())
        try:
            # Stops the listener, closes idle connections, waits for busy ones (our grace plus
            # TERMINAL_FRAME_S), then runs the cleanup contexts.
            await self.runner.cleanup()
        finally:
            ender.cancel()
            await asyncio.gather(ender, return_exceptions=True)
        log.info("server.stopped")

    async def end_streams_after_grace(self) -> None:
        try:
            async with asyncio.timeout(self.grace_s):
                await self.grace_cut_short.wait()
        except TimeoutError:
            pass
        streams = self.app[DISPATCH].streams
        if streams:
            log.warning("server.grace_expired", grace_s=self.grace_s, streams=len(streams))
        systemd.status(f"stopping: ending {len(streams)} streams")
        self.app[LIFECYCLE].shut()  # requests still queued for a slot get their 503 now
        ended: set[StallGuard] = set()
        # Until the runner is done: a request that had a lease but no upstream headers yet at
        # the end of the grace starts its stream later, and is ended as soon as it does.
        while True:
            for guard in streams - ended:
                guard.end_now("shutdown")
                ended.add(guard)
            await asyncio.sleep(END_POLL_S)

    async def keep_status(self) -> None:
        shown = self.status()
        while True:
            await asyncio.sleep(STATUS_EVERY_S)
            now = self.status()
            # Reload and stop write their own STATUS= lines meanwhile.
            if now != shown and not self.reloading and not self.stop_requested.is_set():
                systemd.status(now)
                shown = now

    async def reloads(self) -> None:
        """One reload at a time; SIGHUPs that arrive during one are folded into the next."""
        while True:
            await self.reload_requested.wait()
            self.reload_requested.clear()
            self.reloading = True
            try:
                await self.reload()
            finally:
                self.reloading = False
                done, self.reload_done = self.reload_done, asyncio.Event()
                done.set()
            systemd.ready(self.status())

    async def rescan(self) -> None:
        """A reload asked for now, and awaited: one that is under way already read the file
        before this was asked, so the next one is waited for too."""
        waits = 2 if self.reloading else 1
        self.reload_requested.set()
        for _ in range(waits):
            await self.reload_done.wait()

    async def reload(self) -> None:
        systemd.reloading(f"reloading {self.config_path}")
        log.info("config.reload_started", config=str(self.config_path))
        try:
            # In a thread: a [[library]] rescan reads folders and model headers.
            loaded = with_server_overrides(
                await asyncio.to_thread(configuration.load, self.config_path,
                                        library.find_models),
                self.server_overrides)
        except configuration.ConfigError as exc:
            log_reload_failed(self.config_path, exc.problems)
            return
        # The same rule as at start: a file hal0d would serve nothing with is refused.
        findings = preflight.check(loaded)
        if findings.errors:
            log_reload_failed(self.config_path, [str(error) for error in findings.errors])
            return
        log_warnings(findings.warnings, self.config_path)
        try:
            await self.apply(loaded)
        except Exception:
            # A bug here must not take the daemon down: the old Runtime stays in place (the
            # slot table may be partly changed; the log says where it failed).
            log.exception("config.reload_failed", config=str(self.config_path),
                          keeping="the running configuration")

    async def apply(self, loaded: Config) -> None:
        running = self.config
        restart = restart_needed(running, loaded)
        if restart:
            log.warning("config.restart_needed", keys=restart,
                        note="these keep their running values until hal0d is restarted")
        effective = keep_restart_keys(running, loaded)
        if effective.logging != running.logging:
            logs.configure(effective.logging.level, effective.logging.format,
                           cache_loggers=True)
        logs.hide(known_secrets(effective))
        self.app[HEADS].timeout_s = effective.server.header_timeout_s
        drain_s = drain_time(running)
        lifecycle = self.app[LIFECYCLE]
        diff = ConfigDiff.between(lifecycle.configs, effective.slots, effective.groups)
        await lifecycle.apply(diff, drain_s=drain_s)
        # No await between the slot table change and this swap: see LifecycleManager.apply.
        self.app[RUNTIME].current = Runtime.build(effective)
        if (remote := self.app[DISPATCH].placement.remote) is not None:
            remote.watch(effective.slots)
        await self.app[DEVICES].configure(effective.devices)
        self.app[SHARE_BOOK].configure(effective.dispatcher.share_window_s,
                                       effective.dispatcher.batch_max_wait_s)
        changes = diff.names()
        log.info(
            "config.reloaded",
            config=str(self.config_path),
            slots_added=changes["added"],
            slots_removed=changes["removed"],
            slots_changed=changes["changed"],
            models=len(self.app[RUNTIME].current.router.served_models()),
            aliases=len(effective.models),
            keys=len(effective.keys),
        )
