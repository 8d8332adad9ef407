"""systemd/hal0d.service for real: it verifies clean, rates 1.2 or lower, and runs under systemd.

The boot test (marker `systemd`, root only) starts /lib/systemd/systemd as PID 1 of new PID,
mount, UTS, IPC and cgroup namespaces, in a cgroup of its own, with `container=` set:

* /run, /var/lib, /tmp and /var/tmp are fresh tmpfs and /etc is a copy on /run, so what
  StateDirectory=, ConfigurationDirectory= and PrivateTmp= create never lands on the host;
* a units folder is bound over /etc/systemd/system, a fresh cgroup2 is mounted on
  /sys/fs/cgroup, and /dev/console is a pty of the test (systemd's messages, in systemd.log);
* the network is the host's, so the test reaches hal0d on 127.0.0.1.

systemctl runs inside with nsenter. PID 1 is killed whatever happens, which takes every process
of the namespace with it.

The test copy of the unit keeps every hardening setting of the real one, DynamicUser included,
and changes only what the namespace or the test needs:

* DefaultDependencies=no, and no network-online.target: nothing of the host's boot is pulled in.
* ExecStart: this checkout's virtualenv and a config in /run/hal0dtest (read by the dynamic user:
  0644 in 0755 folders); its slot has a `command` (the stub), so a slot process starts under the
  hardening too.
* WatchdogSec=3, so a SIGSTOPped hal0d is killed and restarted within seconds.
* StandardOutput=append:...: there is no journal in the namespace; the log file shows failures.
* BindReadOnlyPaths= for the checkout, its virtualenv and the Python behind it when they live
  outside /usr, and ProtectHome=tmpfs instead of yes when one of them is under /root or /home
  (a pyenv Python, a clone in a home folder): ProtectHome=yes would hide them, and the tmpfs
  with the bind mounts on top lets the dynamic user reach them even where /root is 0700. Under
  /tmp the bind mounts work the same way through PrivateTmp's fresh /tmp.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.harness.ports import free_port

REPO = Path(__file__).resolve().parent.parent
UNIT = REPO / "systemd" / "hal0d.service"
GPU_DROPIN = REPO / "systemd" / "hal0d.service.d" / "gpu.conf.example"
SYSTEMD = Path("/lib/systemd/systemd")
# The entry point of the virtualenv running these tests (<checkout>/.venv in CI).
HAL0D = Path(sys.executable).parent / "hal0d"
INSIDE = "/run/hal0dtest"  # the staging folder, as seen inside the namespace
BOOT_TIMEOUT_S = 20.0
WATCHDOG_S = 3
HIDDEN_BY_PROTECT_HOME = ("/root", "/home", "/run/user")


def systemd_analyze(*args: str) -> subprocess.CompletedProcess[str]:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    return subprocess.run(["systemd-analyze", *args], capture_output=True, text=True,
                          timeout=60)


def unit_text(**changes: str | None) -> str:
    """The real unit with keys changed: `Key="value"` replaces every `Key=` line with one, None
    removes them; a key the unit lacks goes at the top of [Service] (`Unit_Key` for [Unit])."""
    lines = UNIT.read_text().splitlines()
    for name, value in changes.items():
        section, _, key = name.rpartition("_")
        found = [i for i, line in enumerate(lines) if line.startswith(f"{key}=")]
        at = found[0] if found else lines.index(f"[{section or 'Service'}]") + 1
        lines = [line for i, line in enumerate(lines) if i not in found]
        if value is not None:
            lines.insert(at, f"{key}={value}")
    return "\n".join(lines) + "\n"


def unit_with_existing_binary(folder: Path) -> Path:
    """A copy whose ExecStart names a binary that exists here (verify checks it)."""
    path = folder / "hal0d.service"
    path.write_text(UNIT.read_text().replace("/usr/local/bin/hal0d", str(HAL0D)))
    return path


def test_unit_verifies_without_a_word(tmp_path: Path) -> None:
    """`systemd-analyze verify` prints nothing for the unit and for it with the GPU drop-in."""
    unit = unit_with_existing_binary(tmp_path)
    result = systemd_analyze("verify", str(unit))
    assert (result.returncode, result.stdout + result.stderr) == (0, "")
    (tmp_path / "hal0d.service.d").mkdir()
    shutil.copy(GPU_DROPIN, tmp_path / "hal0d.service.d" / "gpu.conf")
    result = systemd_analyze("verify", str(unit))
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


def exposure(unit: Path) -> float:
    result = systemd_analyze("security", "--offline=true", "--no-pager", str(unit))
    found = re.search(r"Overall exposure level for hal0d\.service: (\d+\.\d+)", result.stdout)
    assert found, result.stdout + result.stderr
    return float(found.group(1))


def test_unit_exposure_is_at_most_1_2(tmp_path: Path) -> None:
    """`systemd-analyze security --offline=true` rates the unit 1.2 or lower (what the README
    shows; a change that weakens the sandbox must say so there), and the GPU drop-in keeps it at
    2.0 or lower (device access is what that drop-in is for)."""
    assert exposure(UNIT) <= 1.2
    unit = tmp_path / "hal0d.service"
    shutil.copy(UNIT, unit)
    (tmp_path / "hal0d.service.d").mkdir()
    shutil.copy(GPU_DROPIN, tmp_path / "hal0d.service.d" / "gpu.conf")
    assert exposure(unit) <= 2.0


# -- the private systemd ---------------------------------------------------------------------


def cgroup2_home() -> Path:
    """A cgroup2 folder this process may make a child in: where it sits in the v2 hierarchy."""
    mount = None
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields, _, rest = line.partition(" - ")
        if rest.split()[0] == "cgroup2":
            mount = Path(fields.split()[4])
            break
    if mount is None:
        pytest.skip("no cgroup2 hierarchy is mounted")
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return mount / line[3:].lstrip("/")
    pytest.skip("this process is in no cgroup2 group")


def remove_cgroup(path: Path) -> None:
    deadline = time.monotonic() + 5
    while path.exists():
        try:
            for folder, _, _ in sorted(os.walk(path), key=lambda w: -len(w[0])):
                os.rmdir(folder)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)  # the killed processes are still being reaped


def children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(child) for child in text.split()]


SETUP = """
set -e
mount -t tmpfs -o mode=0755 tmpfs /run
mkdir -m 0755 {inside}
cp -R {stage}/. {inside}/
chmod -R u+rwX,go+rX {inside}
mount -t tmpfs -o mode=0755 tmpfs /var/lib
{fresh_tmp}
mkdir -m 0755 /run/etc
cp -a /etc/. /run/etc/
mount --bind /run/etc /etc
mount --bind {inside}/units /etc/systemd/system
mount -t cgroup2 cgroup2 /sys/fs/cgroup
mount --bind {console} /dev/console
exec env -i container=hal0dtest PATH=/usr/sbin:/usr/bin:/sbin:/bin \\
    {systemd} --system --unit=hal0dtest.target --show-status=no --log-target=console
"""


class PrivateSystemd:
    """Write the units and files into `stage`, then boot(); close() always, even after a skip."""

    def __init__(self, stage: Path, cgroup: Path) -> None:
        self.stage = stage
        self.cgroup = cgroup
        self.pid = 0  # PID 1 of the namespace, as the host sees it
        self.proc: subprocess.Popen[bytes] | None = None
        # systemd as PID 1 writes to /dev/console, and only to a terminal: it gets a pty of ours
        # (as systemd-nspawn does), copied into this file, instead of the host's console.
        self.console = stage.parent / "systemd.log"
        self._pty: tuple[int, int] | None = None
        self._copier: threading.Thread | None = None
        (stage / "units").mkdir(parents=True)

    @property
    def inside(self) -> Path:
        """The staging folder as copied into the namespace, reached from the host."""
        return Path(f"/proc/{self.pid}/root{INSIDE}")

    def _copy_console(self, master: int) -> None:
        with self.console.open("ab", buffering=0) as out:
            while True:
                try:
                    data = os.read(master, 65536)
                except OSError:
                    return  # EIO: no one holds the terminal open any more
                if not data:
                    return
                out.write(data)

    def boot(self) -> None:
        master, slave = os.openpty()
        self._pty = (master, slave)
        self._copier = threading.Thread(target=self._copy_console, args=(master,), daemon=True)
        self._copier.start()
        setup = SETUP.format(inside=INSIDE, stage=self.stage, systemd=SYSTEMD,
                             console=os.ttyname(slave), fresh_tmp=fresh_tmp())
        (self.stage / "setup.sh").write_text(setup)
        # The shell joins the test's cgroup first: unshare --cgroup makes it the namespace's root.
        self.proc = subprocess.Popen(
            ["sh", "-c",
             f"echo $$ > {self.cgroup}/cgroup.procs && exec unshare --pid --fork --mount "
             f"--uts --ipc --cgroup --mount-proc --propagation private sh {self.stage}/setup.sh"],
            stdin=subprocess.DEVNULL, stdout=self.console.open("ab"), stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                output = self.console.read_text().strip()
                pytest.skip(f"unshare cannot boot a private systemd here: {output}")
            if not self.pid and (pids := children(self.proc.pid)):
                self.pid = pids[0]
            if self.pid and Path(f"/proc/{self.pid}/root/run/systemd/private").exists():
                state = self.systemctl("is-system-running", check=False).stdout.strip()
                if state in ("running", "degraded"):
                    return
            time.sleep(0.1)
        raise AssertionError("the private systemd did not come up\n" + self.diagnostics())

    def close(self) -> None:
        if self.pid:
            # PID 1 of a PID namespace takes every process of the namespace along when it dies.
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        if self.proc is not None:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        if self._pty is not None:
            for fd in self._pty:
                os.close(fd)
        if self._copier is not None:
            self._copier.join(timeout=5)
        remove_cgroup(self.cgroup)

    def systemctl(self, *args: str, check: bool = True,
                  timeout: float = 60) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            ["nsenter", "-t", str(self.pid), "-a", "systemctl", "--no-pager", *args],
            capture_output=True, text=True, timeout=timeout,
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"systemctl {' '.join(args)} failed ({result.returncode}): {result.stderr}\n"
                + self.diagnostics()
            )
        return result

    def show(self, *properties: str) -> dict[str, str]:
        out = self.systemctl("show", "hal0d.service", "-p", ",".join(properties)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def diagnostics(self) -> str:
        def tail(path: Path) -> str:
            with contextlib.suppress(OSError):
                return path.read_text()[-4000:]
            return "(none)"

        return (f"--- hal0d's output:\n{tail(self.inside / 'hal0d.log')}\n"
                f"--- systemd:\n{tail(self.console)}")


@pytest.fixture
def private_systemd(tmp_path: Path) -> Iterator[PrivateSystemd]:
    if os.geteuid() != 0:
        pytest.skip("booting a private systemd needs root")
    if not SYSTEMD.exists():
        pytest.skip(f"{SYSTEMD} does not exist")
    for tool in ("unshare", "nsenter"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    cgroup = cgroup2_home() / f"hal0dtest-{uuid.uuid4().hex[:8]}"
    try:
        cgroup.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot make a cgroup for the private systemd: {exc}")
    system = PrivateSystemd(tmp_path / "stage", cgroup)
    try:
        yield system
    finally:
        system.close()


def service_config(port: int, stub_port: int, *, extra_slot: bool = False) -> str:
    text = f"""
        [server]
        host = "127.0.0.1"
        port = {port}

        [[slots]]
        name = "llm"
        upstream = "http://127.0.0.1:{stub_port}"
        models = ["reasoning", "chat"]
        command = ["hal0d", "stub", "--port", "{stub_port}"]

        [metrics]
        database = "/var/lib/hal0d/history.sqlite3"
    """
    if extra_slot:
        text += f"""
        [[slots]]
        name = "extra"
        upstream = "http://127.0.0.1:{stub_port}"
        models = ["added-by-reload"]
        """
    return textwrap.dedent(text)


def code_paths() -> list[Path]:
    """The checkout, its virtualenv and the Python behind it, where not under /usr."""
    paths = {path.resolve() for path in (REPO, Path(sys.prefix), Path(sys.base_prefix))}
    return sorted(path for path in paths if not path.is_relative_to("/usr"))


def fresh_tmp() -> str:
    """Shell lines that give the namespace empty /tmp and /var/tmp, so PrivateTmp's folders
    never stay behind on the host, and bind back the code paths that lived there."""
    kept = [path for path in code_paths() if path.is_relative_to("/tmp")
            or path.is_relative_to("/var/tmp")]
    lines = [f"mkdir -p /run/keep/{i} && mount --bind {path} /run/keep/{i}"
             for i, path in enumerate(kept)]
    lines += [f"mount -t tmpfs -o mode=1777 tmpfs {tmp}" for tmp in ("/tmp", "/var/tmp")]
    lines += [f"mkdir -p {path} && mount --bind /run/keep/{i} {path}"
              for i, path in enumerate(kept)]
    return "\n".join(lines)


def unit_copy() -> str:
    """The unit the private systemd runs: see the module docstring for every change."""
    binds = code_paths()
    in_home = any(path.is_relative_to(top) for path in binds for top in HIDDEN_BY_PROTECT_HOME)
    return unit_text(
        Unit_DefaultDependencies="no",
        After=None,
        Wants=None,
        ExecStart=f"{HAL0D} serve --config {INSIDE}/hal0d.toml",
        WatchdogSec=str(WATCHDOG_S),
        StandardOutput=f"append:{INSIDE}/hal0d.log",
        StandardError="inherit",
        ProtectHome="tmpfs" if in_home else "yes",
        BindReadOnlyPaths=" ".join(sorted(str(path) for path in binds)) or None,
    )


def http_get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as response:
            return response.status, response.read().decode()
    except OSError as exc:
        return 0, str(exc)


def wait_for(what: str, check: Callable[[], bool], timeout: float,
             system: PrivateSystemd) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}\n" + system.diagnostics())


@pytest.mark.systemd
def test_hal0d_runs_as_a_hardened_notify_service(private_systemd: PrivateSystemd) -> None:
    """start blocks until READY=1 and /healthz answers; a SIGSTOPped hal0d is killed by the
    watchdog and restarted; reload applies a changed config; stop ends it cleanly, exit 0."""
    system = private_systemd
    port, stub_port = free_port(), free_port()
    (system.stage / "units" / "hal0dtest.target").write_text(textwrap.dedent("""
        [Unit]
        Description=hal0d test boot
        DefaultDependencies=no
        # A reference keeps hal0d.service loaded once stopped, so its exit status can be read.
        After=hal0d.service
    """))
    (system.stage / "units" / "hal0d.service").write_text(unit_copy())
    (system.stage / "hal0d.toml").write_text(service_config(port, stub_port))
    system.boot()

    # Type=notify: start returns once hal0d sent READY=1, that is once it listens.
    system.systemctl("start", "hal0d.service", timeout=30)
    status, body = http_get(port, "/healthz")
    assert status == 200, body + system.diagnostics()
    first = system.show("MainPID", "NRestarts", "StatusText", "DynamicUser", "LimitNOFILE",
                        "LimitNOFILESoft")
    assert first["DynamicUser"] == "yes"
    # Started with the unit's soft 1024, hal0d raised its own soft limit to the hard one.
    assert (first["LimitNOFILESoft"], first["LimitNOFILE"]) == ("1024", "524288")
    # (The hard limit it gets is 524288 or, in a container that may not raise its own, less.)
    raised = re.findall(r"server\.fd_limit_raised soft=(\d+) new=(\d+) hard=(\d+)",
                        (system.inside / "hal0d.log").read_text())
    assert len(raised) == 1 and raised[0][0] == "1024" and raised[0][1] == raised[0][2], raised
    assert f"listening on 127.0.0.1:{port}; slots: llm=" in first["StatusText"]
    # The slot's process (the stub) starts under the same hardening and is probed ready.
    wait_for("the stub slot to be ready",
             lambda: '"state":"ready"' in http_get(port, "/api/slots")[1].replace(" ", ""),
             15, system)

    # A hung event loop stops the WATCHDOG=1 pings: systemd aborts hal0d and starts it again.
    system.systemctl("kill", "--signal=SIGSTOP", "--kill-whom=main", "hal0d.service")

    def restarted() -> bool:
        now = system.show("MainPID", "NRestarts", "ActiveState")
        return (
            now["ActiveState"] == "active"
            and now["MainPID"] not in ("0", first["MainPID"])
            and int(now["NRestarts"]) == int(first["NRestarts"]) + 1
            and http_get(port, "/healthz")[0] == 200
        )

    wait_for("the watchdog to restart hal0d", restarted, WATCHDOG_S + 12, system)
    assert "hal0d.service: Watchdog timeout" in system.console.read_text()

    # systemctl reload sends SIGHUP; the new slot's model is served without a restart.
    running = system.show("MainPID")["MainPID"]
    (system.inside / "hal0d.toml").write_text(service_config(port, stub_port, extra_slot=True))
    system.systemctl("reload", "hal0d.service")
    wait_for("the reloaded config",
             lambda: "added-by-reload" in http_get(port, "/v1/models")[1], 10, system)
    assert system.show("MainPID")["MainPID"] == running

    # systemctl stop: SIGTERM, drain, exit 0, well within TimeoutStopSec.
    started = time.monotonic()
    system.systemctl("stop", "hal0d.service")
    took = time.monotonic() - started
    final = system.show("ActiveState", "Result", "ExecMainCode", "ExecMainStatus",
                        "ExecMainPID", "TimeoutStopUSec")
    assert final["ActiveState"] == "inactive", system.diagnostics()
    assert final["Result"] == "success", system.diagnostics()
    assert final["ExecMainPID"] == running
    assert (final["ExecMainCode"], final["ExecMainStatus"]) == ("1", "0")  # exited, status 0
    assert took < 10, f"stop took {took:.1f} s (TimeoutStopSec {final['TimeoutStopUSec']})"
    assert "server.stopped" in (system.inside / "hal0d.log").read_text()
