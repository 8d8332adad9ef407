"""NVIDIA GPUs read through NVML, the library the driver ships (nvidia-smi's own), with NVIDIA's
Python binding `nvidia-ml-py` (module `pynvml`: pure Python, imported without a GPU).

NVML is initialised once (`open_nvml`) and asked per read; its calls block, so the caller runs
`read` in a thread. A box without the driver is no error: `open_nvml` raises `Unavailable`
saying so, and hal0d goes on to the next source. A process whose memory the driver does not
report (usedGpuMemory None, as under some virtualisation) is not counted: hal0d does not guess.
"""

from __future__ import annotations

import threading
from typing import Any, Final

from hal0d.devices.reading import DeviceMemory, ProcessMemory, Unavailable, mib_down, mib_up

SOURCE: Final = "nvml"


class NvmlReader:
    """The NVIDIA GPUs, read through an initialised NVML. Its indexes are NVML's (PCI bus
    order); CUDA's own numbering agrees only with CUDA_DEVICE_ORDER=PCI_BUS_ID."""

    name = SOURCE

    def __init__(self, nvml: Any) -> None:
        self._nvml = nvml
        self._lock = threading.Lock()  # a read and the shutdown may run in two threads

    def read(self) -> tuple[DeviceMemory, ...]:
        nvml = self._nvml
        with self._lock:
            devices = []
            for index in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                memory = nvml.nvmlDeviceGetMemoryInfo(handle)
                name = nvml.nvmlDeviceGetName(handle)
                devices.append(DeviceMemory(
                    index, name.decode() if isinstance(name, bytes) else str(name),
                    mib_down(memory.total), mib_up(memory.used), self._processes(handle)))
            return tuple(devices)

    def _processes(self, handle: Any) -> tuple[ProcessMemory, ...]:
        """Compute and graphics processes, one entry per pid (a process doing both is in both
        lists with the same figure)."""
        nvml = self._nvml
        used: dict[int, int] = {}
        for listed in (nvml.nvmlDeviceGetComputeRunningProcesses(handle),
                       nvml.nvmlDeviceGetGraphicsRunningProcesses(handle)):
            for process in listed:
                if process.usedGpuMemory is not None:
                    used[process.pid] = max(used.get(process.pid, 0),
                                            mib_up(process.usedGpuMemory))
        return tuple(ProcessMemory(pid, mib) for pid, mib in sorted(used.items()))

    def close(self) -> None:
        with self._lock:
            self._nvml.nvmlShutdown()


def open_nvml() -> NvmlReader:
    """NVML initialised, with at least one GPU; Unavailable when there is none to read."""
    try:
        import pynvml
    except ImportError as exc:  # installed with hal0d: only a broken install gets here
        raise Unavailable(f"the pynvml module (nvidia-ml-py) is not importable: {exc}") from None
    try:
        pynvml.nvmlInit()
    except (pynvml.NVMLError_LibraryNotFound, pynvml.NVMLError_DriverNotLoaded):
        raise Unavailable("no NVIDIA driver (NVML's library is not found or its driver is "
                          "not loaded)") from None
    except pynvml.NVMLError as exc:
        raise Unavailable(f"NVML cannot start: {exc}") from None
    try:
        count = pynvml.nvmlDeviceGetCount()
    except pynvml.NVMLError as exc:
        pynvml.nvmlShutdown()
        raise Unavailable(f"NVML cannot count its GPUs: {exc}") from None
    if count == 0:
        pynvml.nvmlShutdown()
        raise Unavailable("the NVIDIA driver is loaded but finds no GPU")
    return NvmlReader(pynvml)
