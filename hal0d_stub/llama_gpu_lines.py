"""What llama-server prints as a model's weights go to a GPU, or fail to for lack of memory, word
for word: the stub loading on the simulated box (device_load.py) prints these, so that hal0d's
recogniser of out-of-memory loads is tested against llama.cpp's own lines, not a paraphrase.

Each template is llama.cpp's format string with its fields named, the `%s: ` of `__func__`
written out, and its source named: the llama.cpp that llama-cpp-python 0.3.36 vendors (the one
tests_real builds llama-server from). The server's and common's own macros (SRV_ERR, COM_ERR)
print `__func__` as `%12.*s`: cut to 12 characters and padded to 12 on the left.

When the weights of one device do not fit, llama.cpp tries that device's buffer (the first
device, in its own numbering, that lacks room), gives up on the model, and the server exits 1;
the error lines go to stderr, the info lines to stdout. Devices are numbered as the process sees
them: with CUDA_VISIBLE_DEVICES=1 the box's device 1 is this process's device 0, "CUDA0". A ROCm
build names its buffers "ROCm0" and still says "cudaMalloc failed" (HIP compiles the CUDA source
with cudaMalloc defined as hipMalloc), with HIP's words for the error, also "out of memory".
"""

from __future__ import annotations

MIB = 1024 * 1024

# A device's share of the weights, as it loaded (INFO, stdout).
# src/llama-model.cpp, llama_model_base::load_tensors: "%s: %12s model buffer size = %8.2f MiB\n"
LOADED = "load_tensors: {buffer:>12} model buffer size = {mib:8.2f} MiB"

# The weights did not fit (ERROR, stderr), in the order llama-server prints them.
OUT_OF_MEMORY = (
    # ggml/src/ggml-cuda/ggml-cuda.cu, ggml_backend_cuda_buffer_type_alloc_buffer:
    # "%s: allocating %.2f MiB on device %d: cudaMalloc failed: %s\n" (cudaGetErrorString)
    "ggml_backend_cuda_buffer_type_alloc_buffer: allocating {mib:.2f} MiB on device {device}: "
    "cudaMalloc failed: out of memory",
    # ggml/src/ggml-alloc.c, alloc_tensor_range: "%s: failed to allocate %s buffer of size %zu\n"
    "alloc_tensor_range: failed to allocate {buffer} buffer of size {size}",
    # src/llama-model.cpp, load_tensors throws "unable to allocate %s buffer"; src/llama.cpp,
    # llama_model_load, catches it: "%s: error loading model: %s\n"
    "llama_model_load: error loading model: unable to allocate {buffer} buffer",
    # src/llama.cpp, llama_model_load_from_file_impl: "%s: failed to load model\n"
    "llama_model_load_from_file_impl: failed to load model",
    # common/common.cpp, common_init_from_params: COM_ERR("failed to load model '%s'\n")
    "cmn  common_init_: failed to load model '{model}'",
    # tools/server/server-context.cpp, load_model: SRV_ERR("failed to load model, '%s'\n")
    "srv    load_model: failed to load model, '{model}'",
    # tools/server/server.cpp, llama_server: SRV_ERR("%s", "exiting due to model loading error\n")
    "srv  llama_server: exiting due to model loading error",
)


def buffer_name(backend: str, device: int) -> str:
    """ggml-cuda.cu's buffer type name: GGML_CUDA_NAME ("CUDA", "ROCm") and the device number."""
    return f"{backend}{device}"


def loaded_line(mib: int, device: int, backend: str = "CUDA") -> str:
    return LOADED.format(buffer=buffer_name(backend, device), mib=mib)


def out_of_memory_lines(mib: int, device: int, model: str, backend: str = "CUDA") -> list[str]:
    """llama-server's lines for `mib` MiB of weights that did not fit on `device` (the process's
    own number for it), loading `model` (its -m path)."""
    fields = {"mib": mib, "device": device, "buffer": buffer_name(backend, device),
              "size": mib * MIB, "model": model}
    return [template.format(**fields) for template in OUT_OF_MEMORY]
