"""The one place that turns `--device` and `--dtype` into what torch runs on: every command that
loads a model (quantize, generate, serve, bench, compile, optkit run's stages) asks here."""

from optkit.errors import OptkitError

DTYPES = ("float32", "bfloat16", "float16")


def resolve_device(device: str = "auto") -> str:
    """ "auto" -> "cuda" when a CUDA device is available, else "cpu"; a CUDA device asked for on a
    machine without one is a user error naming the flag."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise OptkitError(f"--device {device} asked for, but no CUDA device is available: use --device cpu")
    return device


def resolve_dtype(dtype: str | None, device: str) -> str:
    """ "auto" (or None) -> bfloat16 on CUDA, float32 on the CPU. The CPU's choice, by measurement
    (bench/cpu_decode.py on the 2-core AVX-512 machines: AVX512-BF16, no AMX; docs/results.md, "CPU
    decode"; docs/runtime.md, "The CPU's default dtype"): bf16 through oneDNN's packed weights
    (kernels/cpu_bf16.py) decodes faster there (its prefill slower), but is not exact enough for a
    full-precision checkpoint's default: its top token differs from fp32's often enough that greedy
    output would stop matching transformers' fp32 and the gate would
    measure another model than the one it compares against. `--dtype bfloat16` asks for it.
    Quantized artifacts take their own fast kernels either way."""
    if dtype in (None, "auto"):
        return "bfloat16" if device.startswith("cuda") else "float32"
    if dtype not in DTYPES:
        raise OptkitError(f"unknown --dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    return dtype


def set_cpu_threads(threads: int | None) -> None:
    """`--threads N`: the CPU threads torch's kernels use (intra-op); None keeps torch's default
    (the cores it sees)."""
    if threads is None:
        return
    if threads < 1:
        raise OptkitError(f"--threads {threads}: give a positive number of CPU threads")
    import torch

    torch.set_num_threads(threads)
