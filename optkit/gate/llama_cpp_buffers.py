"""Where ggml's AMX kernels fault, load llama.cpp without its extra CPU buffer types.

On a CPU that reports AMX (amx_tile in /proc/cpuinfo) ggml puts quantized weights in its AMX buffer
type, whose tile instructions raised a general protection fault in libggml-cpu on the first
evaluation (llama-cpp-python 0.3.36, a VM that lists amx_tile: every quantized file, F16 ones
fine). llama-cpp-python builds every model's parameters from llama_model_default_params(), so
there `use_extra_bufts` is switched off (the AMX and repacked buffer types: weights stay in the
file's own layout, computed by ggml's generic CPU kernels with the same 8-bit activations).
OPTKIT_LLAMA_CPP_EXTRA_BUFTS=1 keeps them, =0 drops them on any CPU."""

import functools
import os
from pathlib import Path


def cpu_has_amx() -> bool:
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def extra_buffer_types_wanted() -> bool:
    value = os.environ.get("OPTKIT_LLAMA_CPP_EXTRA_BUFTS")
    if value in ("0", "1"):
        return value == "1"
    return not cpu_has_amx()


@functools.cache
def configure_llama_cpp() -> None:
    """Once per process, before a model is loaded: llama-cpp-python's default model parameters without
    the extra buffer types where they are not wanted."""
    if extra_buffer_types_wanted():
        return
    import llama_cpp
    import llama_cpp.llama_cpp as bindings

    defaults = bindings.llama_model_default_params

    def without_extra_buffer_types():
        params = defaults()
        params.use_extra_bufts = False
        return params

    bindings.llama_model_default_params = without_extra_buffer_types
    llama_cpp.llama_model_default_params = without_extra_buffer_types
