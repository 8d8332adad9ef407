"""AMD GPUs read through `amdsmi`, the Python binding ROCm installs beside its libamd_smi (the
package on PyPI is only the binding: without ROCm's library it cannot start). It is not among
hal0d's requirements: where it cannot be imported or started, `open_amdsmi` raises
`Unavailable`, which is no error.

Per device: VRAM's total and use, GTT's too when the device reports it (an APU's models live
mostly there: its VRAM is a small carve-out), and the processes with the VRAM each holds.
amdsmi's calls block: the caller runs `read` in a thread.
"""

from __future__ import annotations

import threading
from typing import Any, Final

from hal0d.devices.reading import (
    DeviceMemory,
    Gtt,
    ProcessMemory,
    Unavailable,
    mib_down,
    mib_up,
)

SOURCE: Final = "amdsmi"


class AmdReader:
    """The AMD GPUs amdsmi found at start, in its order."""

    name = SOURCE

    def __init__(self, amdsmi: Any, handles: list[Any]) -> None:
        self._amdsmi = amdsmi
        self._handles = handles
        self._lock = threading.Lock()  # a read and the shutdown may run in two threads

    def read(self) -> tuple[DeviceMemory, ...]:
        smi, vram = self._amdsmi, self._amdsmi.AmdSmiMemoryType.VRAM
        with self._lock:
            return tuple(
                DeviceMemory(index, self._name(handle),
                             mib_down(smi.amdsmi_get_gpu_memory_total(handle, vram)),
                             mib_up(smi.amdsmi_get_gpu_memory_usage(handle, vram)),
                             self._processes(handle), self._gtt(handle))
                for index, handle in enumerate(self._handles))

    def _name(self, handle: Any) -> str:
        try:
            name = self._amdsmi.amdsmi_get_gpu_asic_info(handle).get("market_name")
        except self._amdsmi.AmdSmiException:
            name = None
        return str(name) if name and name != "N/A" else "AMD GPU"

    def _gtt(self, handle: Any) -> Gtt | None:
        smi, gtt = self._amdsmi, self._amdsmi.AmdSmiMemoryType.GTT
        try:
            return Gtt(mib_down(smi.amdsmi_get_gpu_memory_total(handle, gtt)),
                       mib_up(smi.amdsmi_get_gpu_memory_usage(handle, gtt)))
        except smi.AmdSmiException:
            return None  # a device without GTT figures

    def _processes(self, handle: Any) -> tuple[ProcessMemory, ...]:
        """The processes on the device with the VRAM each holds. amdsmi up to ROCm 6.1 lists
        process handles to ask one by one; later ones list their figures at once. A list it
        refuses (another user's processes, some kernels) leaves the device's own figures."""
        smi = self._amdsmi
        try:
            listed = smi.amdsmi_get_gpu_process_list(handle)
            infos = [entry if isinstance(entry, dict) else
                     smi.amdsmi_get_gpu_process_info(handle, entry) for entry in listed]
        except smi.AmdSmiException:
            return ()
        used: dict[int, int] = {}
        for info in infos:
            vram = (info.get("memory_usage") or {}).get("vram_mem")
            if isinstance(info.get("pid"), int) and isinstance(vram, int):
                used[info["pid"]] = max(used.get(info["pid"], 0), mib_up(vram))
        return tuple(ProcessMemory(pid, mib) for pid, mib in sorted(used.items()))

    def close(self) -> None:
        with self._lock:
            self._amdsmi.amdsmi_shut_down()


def open_amdsmi() -> AmdReader:
    """amdsmi started, with at least one AMD GPU; Unavailable when there is none to read."""
    try:
        import amdsmi
    except Exception as exc:  # not installed, or its library (ROCm's) missing: OSError
        raise Unavailable(f"amdsmi is not importable (it comes with ROCm): {exc}") from None
    try:
        amdsmi.amdsmi_init(amdsmi.AmdSmiInitFlags.INIT_AMD_GPUS)
    except amdsmi.AmdSmiException as exc:
        raise Unavailable(f"amdsmi cannot start: {exc}") from None
    try:
        handles = list(amdsmi.amdsmi_get_processor_handles())
    except amdsmi.AmdSmiException as exc:
        amdsmi.amdsmi_shut_down()
        raise Unavailable(f"amdsmi cannot list its GPUs: {exc}") from None
    if not handles:
        amdsmi.amdsmi_shut_down()
        raise Unavailable("amdsmi finds no AMD GPU")
    return AmdReader(amdsmi, handles)
