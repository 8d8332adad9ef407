"""The devices: each GPU's memory, total, used and free, and which processes hold how much,
read while hal0d runs. What placement will decide loads by; today /api/devices and /metrics
show it.

One module a concern:
  reading.py  the shapes every source gives (Reading, DeviceMemory, ProcessMemory), in MiB
  nvml.py     NVIDIA's GPUs through NVML (nvidia-ml-py)
  amd.py      AMD's GPUs through amdsmi, where ROCm installed it (GTT too)
  command.py  [devices] devices_command: a program's JSON, checked before it is believed
  sources.py  the one interface the three are read through; which library finds a GPU
  owners.py   which slot a process belongs to (/proc: its process group, its parents)
  watch.py    Devices: the source chosen, read on a timer, the last reading and the hour kept
  view.py     what GET /api/devices shows
"""

from hal0d.devices.reading import DeviceMemory, Gtt, ProcessMemory, Reading
from hal0d.devices.watch import Devices

__all__ = ["DeviceMemory", "Devices", "Gtt", "ProcessMemory", "Reading"]
