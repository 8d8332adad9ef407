"""The processes under test: the upstream, hal0d (and its variants), nginx, LiteLLM's proxy.

Each runs as its own child process on a free loopback port, with its output in the run folder,
and is stopped (by its own pid, SIGTERM then SIGKILL; a program that spawns its own children,
by its process group) when the run ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from hal0d.config.ports import unused_port as free_port

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT / "bench" / ".peers"
LITELLM_BIN = PEERS / "litellm" / "bin" / "litellm"


def raise_nofile() -> None:
    """Open-files limit up to the hard limit: 1,000 streams need over 2,000 sockets."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cpu_seconds(pid: int) -> float:
    """CPU time of all a process's threads, at nanosecond resolution (/proc/.../schedstat);
    /proc/<pid>/stat counts in clock ticks, too coarse for a run of a few hundred ms."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as stat:
                total += int(stat.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that just ended
    return total / 1e9


@dataclass
class Child:
    name: str
    port: int
    proc: subprocess.Popen[bytes]
    # Stopped as a process group: a program that spawns children of its own and does not
    # promise to stop them (llama-server's router mode), started in a session of its own.
    group: bool = False
    base: str = field(init=False)

    def __post_init__(self) -> None:
        self.base = f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10 if not self.group else 20)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait(timeout=5)
        if self.group:
            # whatever of the group outlived its leader (the group's id is the leader's pid,
            # kept while any member lives)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    def _signal(self, signum: int) -> None:
        if self.group:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signum)
        else:
            self.proc.send_signal(signum)


class Processes:
    """Starts children and stops every one of them, whatever happens."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.children: list[Child] = []

    def spawn(self, name: str, argv: list[str], port: int, env: dict[str, str] | None = None,
              cwd: Path | None = None, *, group: bool = False) -> Child:
        with open(self.workdir / f"{name}.log", "wb") as log:
            # preexec_fn: the harness has no threads of its own when it spawns.
            proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {})}, cwd=cwd or self.workdir,
                preexec_fn=raise_nofile, start_new_session=True,  # noqa: PLW1509
            )
        child = Child(name, port, proc, group)
        self.children.append(child)
        return child

    def stop_all(self) -> None:
        for child in reversed(self.children):
            child.stop()
        self.children.clear()

    def log_tail(self, child: Child, lines: int = 20) -> str:
        path = self.workdir / f"{child.name}.log"
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


async def wait_until(child: Child, ready: Callable[[aiohttp.ClientSession], object],
                     within_s: float, procs: Processes) -> None:
    deadline = time.monotonic() + within_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if child.proc.poll() is not None:
                raise RuntimeError(f"{child.name} exited ({child.proc.returncode}):\n"
                                   + procs.log_tail(child))
            try:
                if await ready(session):  # type: ignore[misc]
                    return
            except (TimeoutError, aiohttp.ClientError, OSError):
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{child.name} not ready after {within_s:g} s:\n" + procs.log_tail(child))


def http_ok(url: str) -> Callable[[aiohttp.ClientSession], object]:
    async def check(session: aiohttp.ClientSession) -> bool:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as resp:
            await resp.read()
            return resp.status == 200
    return check


def slots_ready(url: str) -> Callable[[aiohttp.ClientSession], object]:
    async def check(session: aiohttp.ClientSession) -> bool:
        async with session.get(url + "/api/slots", timeout=aiohttp.ClientTimeout(total=2)) as r:
            slots = (await r.json())["slots"]
            return bool(slots) and all(s["state"] == "ready" for s in slots)
    return check


# -- the upstream -------------------------------------------------------------------------------

async def start_upstream(procs: Processes, pace_ms: float) -> Child:
    port = free_port()
    child = procs.spawn("upstream", [sys.executable, "-m", "bench.upstream", "--port", str(port),
                                     "--pace-ms", str(pace_ms)], port, cwd=ROOT)
    await wait_until(child, http_ok(f"{child.base}/v1/models"), 15, procs)
    return child


# -- hal0d --------------------------------------------------------------------------------------

def hal0d_toml(port: int, upstream: str, workdir: Path, name: str, *, guard: bool) -> str:
    timeouts = "" if guard else "stream_total_timeout_s = 0\nstream_idle_timeout_s = 0\n"
    return f"""# generated by bench/ for the {name} run
[server]
host = "127.0.0.1"
port = {port}
shutdown_grace_s = 2.0

[dispatcher]
{timeouts}
[metrics]
database = "{workdir / (name + '-history.sqlite3')}"

[logging]
level = "info"
format = "json"

[[slots]]
name = "bench"
upstream = "{upstream}"
models = ["bench", "paced", "paced-20"]
max_concurrent = 2000
max_queue = 2000
"""


async def start_hal0d(procs: Processes, upstream: Child, name: str, *, guard: bool = True,
                      no_metrics: bool = False, uvloop: bool = False,
                      command: Path | None = None) -> Child:
    """hal0d serve as shipped; `no_metrics` and `uvloop` run it through bench.variant;
    `command` runs another installed hal0d (a baseline revision's, see `install_baseline`)."""
    port = free_port()
    config = procs.workdir / f"{name}.toml"
    config.write_text(hal0d_toml(port, upstream.base, procs.workdir, name, guard=guard))
    flags = (["--no-metrics"] if no_metrics else []) + (["--uvloop"] if uvloop else [])
    if flags:
        argv = [sys.executable, "-m", "bench.variant", *flags, "serve", "--config", str(config)]
    else:
        hal0d = command or Path(sys.executable).parent / "hal0d"
        argv = [str(hal0d), "serve", "--config", str(config)]
    # A baseline runs outside the work tree, so this tree's hal0d/ cannot shadow its own.
    child = procs.spawn(name, argv, port, cwd=procs.workdir if command else ROOT)
    await wait_until(child, slots_ready(child.base), 30, procs)
    return child


async def start_floor(procs: Processes, upstream: Child, name: str) -> Child:
    """bench/floor.py in front of the upstream: the bare aiohttp proxy of the latency rows."""
    port = free_port()
    child = procs.spawn(name, [sys.executable, "-m", "bench.floor", "--port", str(port),
                               "--upstream", upstream.base], port, cwd=ROOT)
    await wait_until(child, http_ok(f"{child.base}/healthz"), 15, procs)
    return child


def install_baseline(spec: str) -> tuple[Path, str]:
    """hal0d as it was at a git revision, installed in a virtualenv of its own under
    bench/.peers/baseline-<commit>; returns its `hal0d` command and the full commit.

    `spec` is the revision, optionally followed by `+PATCH` (repeatable): patch files, relative
    to the repository's root, applied to that revision's tree before it is installed
    (bench/counterfactuals/: the baseline with one of its choices undone, say). A patched
    baseline gets a virtualenv of its own, named after the patches' content too.

    The virtualenv borrows this one's site-packages (a .pth line) for hal0d's dependencies and
    installs only hal0d itself (--no-deps): both hal0d versions run on the very same aiohttp,
    orjson and uvloop, so the comparison shows hal0d's own change.
    Built once per commit and patches; a failed build is removed so the next run starts clean.
    """
    rev, *patch_names = spec.split("+")
    commit = subprocess.run(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], cwd=ROOT,
                            capture_output=True, text=True, check=False).stdout.strip()
    if not commit:
        raise RuntimeError(f"BASELINE={rev}: not a git revision of this repository")
    patches = [ROOT / name for name in patch_names]
    if missing := [str(patch) for patch in patches if not patch.is_file()]:
        raise RuntimeError(f"BASELINE={spec}: no such patch file: {', '.join(missing)}")
    digest = hashlib.sha256(b"".join(patch.read_bytes() for patch in patches)).hexdigest()
    venv = PEERS / (f"baseline-{commit[:12]}" + (f"-{digest[:8]}" if patches else ""))
    command = venv / "bin" / "hal0d"
    stamp = venv / ".installed"
    if stamp.exists() and command.exists():
        return command, commit
    shutil.rmtree(venv, ignore_errors=True)
    source = venv / "src"
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        source.mkdir(parents=True)
        archive = subprocess.run(["git", "archive", "--format=tar", commit], cwd=ROOT,
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(source)], input=archive, check=True)
        for patch in patches:
            # The ceiling keeps git apply from taking this repository's root for the tree's.
            subprocess.run(["git", "apply", str(patch)], cwd=source, check=True,
                           env={**os.environ, "GIT_CEILING_DIRECTORIES": str(venv)})
        python = venv / "bin" / "python"
        site = subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True, text=True, check=True).stdout.strip()
        ours = subprocess.run(
            [sys.executable, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True, text=True, check=True).stdout.strip()
        Path(site).mkdir(parents=True, exist_ok=True)
        # Appended after the baseline's own site-packages: its hal0d wins over this tree's.
        (Path(site) / "zz-bench-dependencies.pth").write_text(ours + "\n")
        subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                        "--quiet", "--no-deps", str(source)],
                       check=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        shutil.rmtree(venv, ignore_errors=True)
        raise RuntimeError(f"BASELINE={spec}: could not install it: {exc}") from exc
    stamp.touch()
    return command, commit


# -- nginx --------------------------------------------------------------------------------------

def nginx_conf(port: int, upstream: Child, prefix: Path) -> str:
    return f"""# generated by bench/: one worker, no buffering, keepalive to the upstream
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/nginx-error.log warn;
worker_rlimit_nofile 8192;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/client_body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    upstream bench_upstream {{
        server 127.0.0.1:{upstream.port};
        keepalive 128;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://bench_upstream;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout 600s;
        }}
    }}
}}
"""


def nginx_binary() -> str | None:
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.path.exists(p)), None)


async def start_nginx(procs: Processes, upstream: Child) -> Child:
    binary = nginx_binary()
    if binary is None:
        raise RuntimeError("nginx is not installed (make bench-peers installs it with apt-get)")
    port = free_port()
    prefix = procs.workdir / "nginx"
    prefix.mkdir(exist_ok=True)
    conf = prefix / "nginx.conf"
    conf.write_text(nginx_conf(port, upstream, prefix))
    child = procs.spawn("nginx", [binary, "-p", str(prefix), "-c", str(conf),
                                  "-g", "daemon off; master_process off;"], port)
    await wait_until(child, http_ok(f"{child.base}/v1/models"), 15, procs)
    return child


def nginx_version() -> str | None:
    binary = nginx_binary()
    if binary is None:
        return None
    out = subprocess.run([binary, "-v"], capture_output=True, text=True, check=False).stderr.strip()
    return out.split("/", 1)[-1] or None


# -- LiteLLM ------------------------------------------------------------------------------------

def litellm_yaml(upstream: Child) -> str:
    return f"""# generated by bench/: one openai/ model in front of the bench upstream
model_list:
  - model_name: bench
    litellm_params:
      model: openai/bench
      api_base: {upstream.base}/v1
      api_key: sk-bench
litellm_settings:
  telemetry: false
  set_verbose: false
  drop_params: true
"""


async def start_litellm(procs: Processes, upstream: Child) -> Child:
    if not LITELLM_BIN.exists():
        raise RuntimeError(f"LiteLLM is not installed ({LITELLM_BIN} missing; "
                           "make bench-peers installs it)")
    port = free_port()
    conf = procs.workdir / "litellm.yaml"
    conf.write_text(litellm_yaml(upstream))
    env = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR",
           "LITELLM_TELEMETRY": "False", "NO_DOCS": "True", "DISABLE_ADMIN_UI": "True"}
    child = procs.spawn("litellm", [str(LITELLM_BIN), "--config", str(conf), "--host",
                                    "127.0.0.1", "--port", str(port), "--num_workers", "1"],
                        port, env=env)
    await wait_until(child, http_ok(f"{child.base}/health/liveliness"), 180, procs)
    return child


def litellm_version() -> str | None:
    python = LITELLM_BIN.parent / "python"
    if not python.exists():
        return None
    out = subprocess.run([str(python), "-c", "import importlib.metadata as m; "
                          "print(m.version('litellm'))"], capture_output=True, text=True,
                         check=False)
    return out.stdout.strip() or None
