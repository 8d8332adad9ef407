"""The `[devices] devices_command`: a program hal0d runs to read devices it has no library for
(another vendor, a remote box, a simulated GPU in the tests), printing JSON:

    {"devices": [{"index": 0, "name": "RTX 4090", "total_mib": 24576, "used_mib": 1200,
                  "processes": [{"pid": 123, "used_mib": 900}],
                  "gtt": {"total_mib": 65536, "used_mib": 0}}]}

`name`, `processes` and `gtt` may be left out; other keys are ignored. What it prints is data to
check, not to trust: a wrong type, a negative figure, more used than there is, an index or a
pid given twice, output that is no JSON or longer than OUTPUT_LIMIT, a program that does not
exit within TIMEOUT_S or exits with another code than 0: each is a `ReadFailed` naming the
first thing wrong, by its path in the JSON (`devices[1].used_mib: ...`), in one line.
"""

from __future__ import annotations

from typing import Any, Final

import orjson

from hal0d.devices.reading import DeviceMemory, Gtt, ProcessMemory, ReadFailed
from hal0d.programs import ProgramFailed, run_program

SOURCE: Final = "command"
TIMEOUT_S: Final = 5.0
OUTPUT_LIMIT: Final = 1 << 20
SHOWN_STDERR: Final = 200  # of a failed run's stderr, in its error line
SHOWN_OUTPUT: Final = 60  # of what is no JSON, in its error line


class BadOutput(ReadFailed):
    """The program ran but what it printed is not a reading."""


class CommandSource:
    """Reads the devices by running `command` once per read."""

    name = SOURCE

    def __init__(self, command: tuple[str, ...]) -> None:
        self.command = command

    async def read(self) -> tuple[DeviceMemory, ...]:
        try:
            done = await run_program(self.command, timeout_s=TIMEOUT_S, max_output=OUTPUT_LIMIT)
        except ProgramFailed as exc:
            raise ReadFailed(f"devices_command: {exc}") from None
        if done.code != 0:
            said = done.err.decode("utf-8", "replace").strip().splitlines()
            why = f": {said[-1][:SHOWN_STDERR]}" if said else ""
            raise ReadFailed(f"devices_command: exited with code {done.code}{why}")
        return parse_devices(done.out)

    async def close(self) -> None:
        return None


def parse_devices(out: bytes) -> tuple[DeviceMemory, ...]:
    """The devices a devices_command printed; BadOutput naming the first thing wrong."""
    try:
        data = orjson.loads(out)
    except orjson.JSONDecodeError:
        text = out.decode("utf-8", "replace").strip()
        if not text:
            raise BadOutput("devices_command: printed nothing") from None
        shown = repr(text[:SHOWN_OUTPUT]) + ("..." if len(text) > SHOWN_OUTPUT else "")
        raise BadOutput(f"devices_command: printed no JSON: {shown}") from None
    if not isinstance(data, dict) or not isinstance(data.get("devices"), list):
        raise BadOutput('devices_command: printed no {"devices": [...]} object')
    devices: list[DeviceMemory] = []
    seen: dict[int, int] = {}
    for position, raw in enumerate(data["devices"]):
        where = f"devices[{position}]"
        device = _device(raw, where)
        if device.index in seen:
            raise BadOutput(f"devices_command: {where}.index: {device.index} is devices"
                            f"[{seen[device.index]}]'s too")
        seen[device.index] = position
        devices.append(device)
    return tuple(devices)


def _device(raw: Any, where: str) -> DeviceMemory:
    if not isinstance(raw, dict):
        raise BadOutput(f"devices_command: {where}: {_shown(raw)} is not an object")
    index = _count(raw, "index", where)
    total = _count(raw, "total_mib", where)
    used = _count(raw, "used_mib", where)
    if used > total:
        raise BadOutput(f"devices_command: {where}.used_mib: {used} is more than its "
                        f"total_mib {total}")
    name = raw.get("name", f"device {index}")
    if not isinstance(name, str):
        raise BadOutput(f"devices_command: {where}.name: {_shown(name)} is not a string")
    processes = raw.get("processes", [])
    if not isinstance(processes, list):
        raise BadOutput(f"devices_command: {where}.processes: {_shown(processes)} is not a "
                        "list")
    return DeviceMemory(index, name, total, used, _processes(processes, total, where),
                        _gtt(raw["gtt"], f"{where}.gtt") if "gtt" in raw else None)


def _processes(raw: list[Any], total: int, where: str) -> tuple[ProcessMemory, ...]:
    processes: list[ProcessMemory] = []
    pids: set[int] = set()
    for position, entry in enumerate(raw):
        at = f"{where}.processes[{position}]"
        if not isinstance(entry, dict):
            raise BadOutput(f"devices_command: {at}: {_shown(entry)} is not an object")
        pid, used = _count(entry, "pid", at), _count(entry, "used_mib", at)
        if pid == 0:
            raise BadOutput(f"devices_command: {at}.pid: 0 is no process")
        if pid in pids:
            raise BadOutput(f"devices_command: {at}.pid: {pid} is listed twice")
        if used > total:
            raise BadOutput(f"devices_command: {at}.used_mib: {used} is more than the "
                            f"device's total_mib {total}")
        pids.add(pid)
        processes.append(ProcessMemory(pid, used))
    return tuple(processes)


def _gtt(raw: Any, where: str) -> Gtt:
    if not isinstance(raw, dict):
        raise BadOutput(f"devices_command: {where}: {_shown(raw)} is not an object")
    total, used = _count(raw, "total_mib", where), _count(raw, "used_mib", where)
    if used > total:
        raise BadOutput(f"devices_command: {where}.used_mib: {used} is more than its "
                        f"total_mib {total}")
    return Gtt(total, used)


def _count(raw: dict[str, Any], key: str, where: str) -> int:
    """A whole number of at least 0 (a JSON `true` is none: bool is an int in Python)."""
    if key not in raw:
        raise BadOutput(f"devices_command: {where}.{key}: is missing")
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadOutput(f"devices_command: {where}.{key}: {_shown(value)} is not a whole "
                        "number")
    if value < 0:
        raise BadOutput(f"devices_command: {where}.{key}: {value} is negative")
    return value


def _shown(value: Any) -> str:
    """A value as an error line shows it: short, whatever the program printed."""
    text = orjson.dumps(value).decode()
    return text if len(text) <= 40 else text[:40] + "..."
