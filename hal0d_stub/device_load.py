"""The stub's model load on the simulated GPU box (`hal0d stub --device-state FILE
--footprint-mib N`): it takes its footprint from the box as llama-server puts its weights on the
GPUs its environment lets it see, and fails the load with llama.cpp's own out-of-memory lines
when they lack room.

    CUDA_VISIBLE_DEVICES ("1", "0,1"; else HIP_VISIBLE_DEVICES; neither: the box's device 0)
      -> the devices it sees, in that order -> the footprint split over them (by --tensor-split
         as llama-server's -ts, else as llama.cpp splits by default: in proportion to each
         device's free memory) -> one all-or-nothing allocation
      -> it fits: "load_tensors: CUDA0 model buffer size = ..." per device, and the stub serves;
         its memory is released when it exits (normal exit, SIGTERM, SIGINT), and by the box's
         own rule for a process that is gone when it is killed
      -> it does not: llama-server's out-of-memory lines for the first device short of room,
         nothing allocated, exit 1

As with a real CUDA runtime, the list stops at the first entry that is no device of the box, and
a list that names none leaves the stub without a GPU: it loads on the CPU and takes nothing.
Where neither variable is set, the stub loads on device 0 alone, where llama-server would see
every GPU and split by their free memory: a test names its devices, and a stub that was given
none piles onto one device, where the mistake shows.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import re
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType

from hal0d_stub import device, llama_gpu_lines

NO_MODEL_PATH = "model.gguf"  # named in the lines of a stub started without -m


@dataclasses.dataclass(frozen=True)
class DeviceLoad:
    state: Path  # the box's file
    footprint_mib: int
    tensor_split: tuple[float, ...] = ()  # proportions per visible device, as llama-server's -ts
    model: str = NO_MODEL_PATH


def parse_tensor_split(text: str) -> tuple[float, ...]:
    """llama-server's -ts: proportions separated by ',' or '/', e.g. "3,1"."""
    proportions = tuple(float(part) for part in re.split(r"[,/]+", text.strip()) if part)
    if not proportions or any(p < 0 for p in proportions) or not any(proportions):
        raise ValueError(f"a tensor split is proportions of 0 or more, not all 0: {text!r}")
    return proportions


def visible_devices(environ: Mapping[str, str], box: device.Box) -> tuple[str, list[int]]:
    """The backend's name ("CUDA", or "ROCm" when only HIP_VISIBLE_DEVICES is set) and the box's
    devices the process sees, in the order it numbers them (device 0 when neither is set)."""
    listed, backend = environ.get("CUDA_VISIBLE_DEVICES"), "CUDA"
    if listed is None and "HIP_VISIBLE_DEVICES" in environ:
        listed, backend = environ["HIP_VISIBLE_DEVICES"], "ROCm"
    on_the_box = [d.index for d in box.devices]
    if listed is None:
        return backend, on_the_box[:1]
    seen: list[int] = []
    for entry in (part.strip() for part in listed.split(",")):
        if not entry.isdigit() or int(entry) not in on_the_box or int(entry) in seen:
            break  # the CUDA runtime's rule: an invalid entry hides it and all after it
        seen.append(int(entry))
    return backend, seen


def split_footprint(footprint_mib: int, devices: Sequence[int],
                    tensor_split: Sequence[float] = ()) -> dict[int, int]:
    """{device: MiB}, adding up to the footprint: by the split's proportions (a device past its
    end gets 0), or evenly; what rounding leaves goes to the first devices with a share."""
    weights = [tensor_split[i] if i < len(tensor_split) else 0.0 for i in range(len(devices))]
    if not any(weights):
        weights = [1.0] * len(devices)
    total = sum(weights)
    shares = [int(footprint_mib * w / total) for w in weights]
    with_share = [i for i, w in enumerate(weights) if w > 0]
    for i in range(footprint_mib - sum(shares)):
        shares[with_share[i % len(with_share)]] += 1
    return {d: mib for d, mib in zip(devices, shares, strict=True) if mib > 0}


def free_memory(box: device.Box, devices: Sequence[int]) -> tuple[float, ...]:
    """Each of `devices`' free MiB: llama.cpp's default split (no -ts) is in proportion to it."""
    return tuple(float(max(0, box.free_mib(index))) for index in devices)


def claim(load: DeviceLoad, environ: Mapping[str, str] = os.environ) -> bool:
    """Takes this process's footprint from the box (True), or prints llama-server's
    out-of-memory lines and takes nothing (False: the caller exits 1 as llama-server does)."""
    try:
        box = device.read_box(load.state)
    except FileNotFoundError as exc:
        print(f"stub: --device-state: {exc}", file=sys.stderr, flush=True)
        return False
    backend, devices = visible_devices(environ, box)
    if not devices:
        print("stub: no simulated GPU visible: the model loads on the CPU", flush=True)
        return True
    shares = split_footprint(load.footprint_mib, devices,
                             load.tensor_split or free_memory(box, devices))
    release_when_exiting(load.state)
    shortfall = device.allocate(load.state, os.getpid(), shares)
    if shortfall is None:
        for own, index in enumerate(devices):
            if index in shares:
                print(llama_gpu_lines.loaded_line(shares[index], own, backend), flush=True)
        return True
    # llama.cpp allocates device by device and stops at the first that fails.
    own, index = next((own, index) for own, index in enumerate(devices) if index in shortfall)
    for line in llama_gpu_lines.out_of_memory_lines(shares[index], own, load.model, backend):
        print(line, file=sys.stderr)
    sys.stderr.flush()
    return False


def release_when_exiting(state: Path) -> None:
    """From here on the process's memory is released as it exits: on a normal exit and on an
    exception that ends it (SIGINT's KeyboardInterrupt, and SIGTERM, made a SystemExit of status
    143 here, as a shell reports a process SIGTERM ended) through atexit. aiohttp's run_app
    handles SIGTERM and SIGINT itself while it serves and then returns, and the exit follows.
    Only SIGKILL leaves the allocation behind, and the box drops it by itself once the process
    is gone. The SIGTERM handler raises rather than releases: the signal may come while this
    process holds the box's lock, and a second flock of its own would wait for it forever."""
    pid = os.getpid()

    def release() -> None:
        with contextlib.suppress(FileNotFoundError):  # the box was removed first: nothing held
            device.release(state, pid=pid)

    atexit.register(release)

    def exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, exit_on_sigterm)
