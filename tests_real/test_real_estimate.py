"""The memory estimate (hal0d/library/gguf_facts.py) against llama-server's own accounting: the
SmolLM2 file run at several contexts, the model buffer and KV buffer sizes its log prints added
up and compared with ModelFacts.estimate_mib, which must be within 15 % of them.

llama-server prints those sizes only at log verbosity 4 (`-lv 4`); at its default (3) the log
says nothing of its memory. Its default --parallel is "auto": 4 slots sharing one unified KV
cache of `-c` cells, each slot allowed all of them; with `-np 2` each of the 2 slots gets half.
Either way the KV buffer holds `-c` cells in all, which is what the estimate counts.

Run by `make test-real` (see test_real_model.py for the server and the model); `pytest -s`
shows the figures.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from realserver import (
    REAL_MODEL,
    REAL_SERVER,
    STARTUP_S,
    free_port,
    require_real_server,
    stop_process,
)

from hal0d.library.gguf_facts import MIB, read_facts

TOLERANCE = 0.15
MODEL_BUFFER = re.compile(r"model buffer size\s*=\s*([\d.]+) MiB")
KV_BUFFER = re.compile(r"KV buffer size\s*=\s*([\d.]+) MiB")
READY = "listening on"


@pytest.fixture(autouse=True)
def _real() -> None:
    require_real_server()


def buffer_mib(folder: Path, context: int, extra: Sequence[str]) -> tuple[float, float]:
    """(model buffer, KV buffer) in MiB as llama-server's log reports them, every buffer of
    each kind added up (a model split between devices, or a sliding-window model's two
    caches, prints several)."""
    log_path = folder / f"llama-server-{context}.log"
    command = [REAL_SERVER, "-m", REAL_MODEL, "--host", "127.0.0.1", "--port", str(free_port()),
               "-c", str(context), "--no-webui", "-lv", "4", *extra]
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + STARTUP_S
            while READY not in log_path.read_text():
                assert process.poll() is None, log_path.read_text()[-3000:]
                assert time.monotonic() < deadline, log_path.read_text()[-3000:]
                time.sleep(0.2)
        finally:
            stop_process(process)
    text = log_path.read_text()
    model = [float(size) for size in MODEL_BUFFER.findall(text)]
    kv = [float(size) for size in KV_BUFFER.findall(text)]
    assert model and kv, text[-3000:]
    return sum(model), sum(kv)


@pytest.mark.parametrize(("context", "extra", "cache_types"), [
    (2048, (), ("f16", "f16")),
    (8192, (), ("f16", "f16")),
    (4096, ("-np", "2"), ("f16", "f16")),  # two slots of 2048 cells each
    (4096, ("-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"), ("q8_0", "q8_0")),
], ids=["c2048", "c8192", "c4096-np2", "c4096-q8_0"])
def test_the_estimate_is_within_15_percent_of_llama_servers_buffers(
        tmp_path: Path, context: int, extra: Sequence[str], cache_types: tuple[str, str]) -> None:
    facts = read_facts(Path(REAL_MODEL))
    estimate = facts.estimate_mib(context, *cache_types)
    model, kv = buffer_mib(tmp_path, context, extra)
    print(f"\n{' '.join(['-c', str(context), *extra])}: estimate {estimate} MiB (weights "
          f"{facts.weights_bytes / MIB:.2f} + KV {facts.kv_bytes(context, *cache_types) / MIB:.2f})"
          f"; llama-server {model + kv:.2f} MiB (model buffer {model:.2f} + KV buffer {kv:.2f})")
    assert abs(estimate - (model + kv)) <= TOLERANCE * (model + kv)
