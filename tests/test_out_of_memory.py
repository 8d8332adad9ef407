"""A load that fails for lack of device memory is told as such: the server's own lines (llama.cpp's,
word for word, as the stub on the simulated GPU box prints them; CUDA's, ROCm's and vLLM's) are
recognised while it loads, and the failed load's 503, its reason and the log name the memory
it asked for. Over a real `hal0d serve`, a real stub process and a simulated box."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import aiohttp
import orjson

from hal0d.lifecycle.out_of_memory import OutOfMemory, out_of_memory
from hal0d_stub.device import make_box
from hal0d_stub.llama_gpu_lines import loaded_line, out_of_memory_lines
from tests.harness.daemons import serving
from tests.harness.gpu_box import box_config, box_slot, run_devices
from tests.harness.ports import free_port


def test_llama_cpps_own_lines_are_recognised_with_what_they_asked() -> None:
    lines = out_of_memory_lines(6000, 1, "/m/q.gguf")
    found = [out_of_memory(line) for line in lines]
    assert found[0] == OutOfMemory(lines[0], 6000.0, 1)  # "allocating 6000.00 MiB on device 1"
    assert found[1] == OutOfMemory(lines[1], 6000.0, 1)  # "failed to allocate CUDA1 buffer"
    assert found[2] == OutOfMemory(lines[2])  # "unable to allocate CUDA1 buffer": no size
    assert found[3:] == [None] * (len(lines) - 3)  # "failed to load model" is any failure
    rocm = out_of_memory_lines(512, 0, "/m/q.gguf", backend="ROCm")
    assert out_of_memory(rocm[1]) == OutOfMemory(rocm[1], 512.0, 0)
    assert out_of_memory(loaded_line(6000, 0)) is None


def test_the_runtimes_and_vllms_words_are_recognised_and_others_are_not() -> None:
    for line in ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
                 "ValueError: No available memory for the cache blocks. Try increasing "
                 "`gpu_memory_utilization` when initializing the engine.",
                 "RuntimeError: HIP out of memory", "hipErrorOutOfMemory"):
        assert out_of_memory(line) == OutOfMemory(line), line
    for line in ("llama_kv_cache: CUDA0 KV buffer size = 180.00 MiB",
                 "srv  llama_server: exiting due to model loading error",
                 "the model keeps talking about memory"):
        assert out_of_memory(line) is None, line
    told = "out of memory: 6000 MiB could not be had on device 1"
    assert str(OutOfMemory("x", 6000.0, 1)) == told


async def test_a_load_that_does_not_fit_fails_naming_the_memory_it_asked(
        tmp_path: Path, http: aiohttp.ClientSession) -> None:
    box = tmp_path / "box.json"
    make_box(box, [24576])
    port, upstream_port = free_port(), free_port()

    def stub(footprint: int, stub_port: int) -> str:
        return orjson.dumps([sys.executable, "-m", "hal0d", "stub", "--port", str(stub_port),
                             "--device-state", str(box), "--footprint-mib",
                             str(footprint)]).decode()

    fits_port = free_port()
    config = tmp_path / "hal0d.toml"
    config.write_text(textwrap.dedent(f"""
        [server]
        port = {port}

        [[slots]]
        name = "big"
        upstream = "http://127.0.0.1:{upstream_port}"
        models = ["chat"]
        start = "on_demand"
        command = {stub(30000, upstream_port)}

        [[slots]]
        name = "fits"
        upstream = "http://127.0.0.1:{fits_port}"
        models = ["reasoning"]
        start = "on_demand"
        command = {stub(6000, fits_port)}

        [metrics]
        database = "{tmp_path / 'history.sqlite3'}"

        [logging]
        format = "json"
    """))
    body = {"model": "chat", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    async with serving(config, port) as hal0d:
        async with http.post(f"{hal0d.url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 503, await resp.text()
            error = (await resp.json())["error"]
        assert error["code"] == "slot.load_failed"
        assert error["message"].startswith(
            "slot 'big' could not load its model: out of memory: 30000 MiB could not be had on "
            "device 0; process exited with code 1"), error
        noted = await hal0d.wait_for_event("slot.load_out_of_memory")
        assert (noted["slot"], noted["asked_mib"], noted["device"]) == ("big", 30000.0, 0)
        async with http.post(f"{hal0d.url}/v1/chat/completions",
                             json=body | {"model": "reasoning"}) as resp:
            assert resp.status == 200, await resp.text()  # what fits loads
        assert not [line for line in hal0d.named("slot.load_out_of_memory")
                    if line["slot"] == "fits"]


async def test_a_load_out_of_memory_is_retried_once_with_room_made_for_what_it_asked(
        tmp_path: Path, http: aiohttp.ClientSession) -> None:
    """`b` is guessed at 10 GiB and takes 20: beside `a` (8 GiB) on a 24 GiB GPU it runs out
    of memory. Its footprint is raised to the 20 GiB it asked, `a` (idle) is unloaded for it,
    and the one retry loads it: the client gets its answer, never the failed load."""
    box = tmp_path / "box.json"
    make_box(box, [24576])
    port = free_port()

    def stub_slot(name: str, model: str, footprint: int, guess: int) -> str:
        stub_port = free_port()
        command = [sys.executable, "-m", "hal0d", "stub", "--port", str(stub_port),
                   "--device-state", str(box), "--footprint-mib", str(footprint)]
        return textwrap.dedent(f"""
            [[slots]]
            name = "{name}"
            upstream = "http://127.0.0.1:{stub_port}"
            models = ["{model}"]
            start = "on_demand"
            group = "gpu"
            memory_mib = {guess}
            command = {orjson.dumps(command).decode()}
        """)

    config = tmp_path / "hal0d.toml"
    config.write_text(textwrap.dedent(f"""
        [server]
        port = {port}

        [groups.gpu]
        memory_mib = 24000
    """) + stub_slot("a", "chat", 8000, 8000) + stub_slot("b", "reasoning", 20000, 10000)
        + textwrap.dedent(f"""
        [metrics]
        database = "{tmp_path / 'history.sqlite3'}"

        [logging]
        format = "json"
    """))
    body = {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    async with serving(config, port) as hal0d:
        for model in ("chat", "reasoning"):
            async with http.post(f"{hal0d.url}/v1/chat/completions",
                                 json=body | {"model": model}) as resp:
                assert resp.status == 200, await resp.text()
        retried = hal0d.named("slot.load_retrying")
        assert [(line["slot"], line["need_mib"]) for line in retried] == [("b", 20000)]
        raised = hal0d.named("slot.footprint_raised")
        assert [(line["slot"], line["mib"], line["was_mib"]) for line in raised] == [
            ("b", 20000, 10000)]
        unloaded = [line["slot"] for line in hal0d.named("slot.unloaded")]
        assert unloaded == ["a"], unloaded  # made room for the 20 GiB it asked
        async with http.get(f"{hal0d.url}/api/slots") as resp:
            views = {view["name"]: view for view in (await resp.json())["slots"]}
        assert views["b"]["state"] == "ready" and views["a"]["state"] == "stopped"
        assert views["b"]["memory"]["raised_by_out_of_memory"] is True


async def test_a_load_placed_on_the_second_gpu_is_told_out_of_memory_there_and_refused_by_it(
        tmp_path: Path, http: aiohttp.ClientSession) -> None:
    """A model guessed at 1 GiB takes 30: placed on device 1 (a desktop fills device 0), its
    server, which sees device 1 as its CUDA0, runs out of memory "on device 0": hal0d tells it
    of device 1. With its footprint raised to the 30 GiB it asked, it fits on no device and
    nothing hal0d runs can be unloaded for it: the retry is not tried, and the client is told
    the figures."""
    state = tmp_path / "box.json"
    make_box(state, [24576, 24576])
    assert (await run_devices(state, "--take", "24000", "--device", "0"))[0] == 0
    port = free_port()
    config = tmp_path / "hal0d.toml"
    config.write_text(box_config(port, state, tmp_path,
                                 box_slot("big", "chat", state, 30000, 1024)))
    body = {"model": "chat", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    async with serving(config, port) as hal0d:
        async with http.post(f"{hal0d.url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 503, await resp.text()
            error = (await resp.json())["error"]
        noted = hal0d.named("slot.load_out_of_memory")
        assert [(line["asked_mib"], line["device"]) for line in noted] == [(30000.0, 1)]
        assert error["message"] == (
            "slot 'big' could not load its model: out of memory: 30000 MiB could not be had on "
            "device 1; no room on the devices: big needs 30000 MiB (device 0: 576 MiB free, 512 "
            "kept, device 1: 24576 MiB free, 512 kept); no model hal0d may unload frees "
            "enough"), error
        assert len(hal0d.named("slot.process_started")) == 1  # no retry bound to fail
