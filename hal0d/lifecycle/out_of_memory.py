"""A load that failed for lack of device memory, told from the server's own output.

What the model servers print when a model does not fit (matched word for word; the stub on the
simulated GPU box prints llama.cpp's lines, hal0d_stub/llama_gpu_lines.py):

    llama.cpp, CUDA and ROCm    "allocating 6000.00 MiB on device 0: cudaMalloc failed: out of
                                memory", "failed to allocate CUDA0 buffer of size N",
                                "unable to allocate CUDA0 buffer" (the weights or the KV cache)
    CUDA and ROCm runtimes      "CUDA out of memory", "CUDA error: out of memory",
                                "HIP out of memory", "hipErrorOutOfMemory"
    PyTorch (vLLM)              "torch.OutOfMemoryError", "torch.cuda.OutOfMemoryError"
    vLLM                        "No available memory for the cache blocks"

A failed load's reason then says so first, with what was asked where the line says it, so the
503 its waiters get and the log name the memory figures. Only lines printed while the process
loads are read (a server answering requests prints many; none of them is a failed load).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

# Cheap words first: a line without any of them is no such line (most lines of a load).
_WORDS: Final = ("memory", "allocate", "OutOfMemory")
_ALLOCATING: Final = re.compile(
    r"allocating ([0-9.]+) MiB on device (\d+): \w+ failed: out of memory")
_BUFFER: Final = re.compile(r"failed to allocate (\w+?)(\d+) buffer of size (\d+)")
_OTHERS: Final = re.compile(
    r"unable to allocate \w+ buffer|CUDA out of memory|CUDA error: out of memory|"
    r"HIP out of memory|hipErrorOutOfMemory|torch\.(?:cuda\.)?OutOfMemoryError|"
    r"No available memory for the cache blocks")
MIB: Final = 1024 * 1024


@dataclass(frozen=True, slots=True)
class OutOfMemory:
    """What a server said of memory it could not have: the line, and where it says so, how
    much it asked on which of its devices (its own numbering)."""

    line: str
    asked_mib: float | None = None
    device: int | None = None

    def __str__(self) -> str:
        if self.asked_mib is not None:
            where = f" on device {self.device}" if self.device is not None else ""
            return f"out of memory: {self.asked_mib:.0f} MiB could not be had{where}"
        return f"out of memory: {self.line}"


def out_of_memory(line: str) -> OutOfMemory | None:
    """The out-of-memory failure `line` tells of, None when it tells of none."""
    if not any(word in line for word in _WORDS):
        return None
    if (found := _ALLOCATING.search(line)) is not None:
        return OutOfMemory(line, float(found[1]), int(found[2]))
    if (found := _BUFFER.search(line)) is not None:
        return OutOfMemory(line, int(found[3]) / MIB, int(found[2]))
    if _OTHERS.search(line) is not None:
        return OutOfMemory(line)
    return None
