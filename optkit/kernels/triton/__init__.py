"""Triton versions of the kernels in `optkit.kernels`, for CUDA tensors.

Each module here mirrors one reference module (paged_attention, w4a16 for packed_int, w8a8) and is only imported
by that module's wrapper once it holds a CUDA tensor, so CPU runs never import triton. The modules
also run on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1, set before triton is
imported), which is how the tests check them against the references on machines without a GPU.

Dispatch: a wrapper in `optkit.kernels` takes the Triton path when `use_triton(tensor)` is true (a
CUDA tensor, triton importable, and OPTKIT_TRITON not set to 0) and the kernel supports the layout;
everything else runs the plain-PyTorch reference.
"""

import functools
import logging
import os

import torch

log = logging.getLogger(__name__)


@functools.cache
def available() -> bool:
    """Whether triton imports (checked once, and only when a CUDA tensor asks)."""
    try:
        import triton  # noqa: F401
    except ImportError as e:
        log.info("triton is not importable (%s): CUDA tensors use the PyTorch reference kernels", e)
        return False
    return True


def use_triton(t: torch.Tensor) -> bool:
    """Whether the Triton kernels should run for this tensor. OPTKIT_TRITON=0 turns them off (for A/B runs)."""
    return t.is_cuda and os.environ.get("OPTKIT_TRITON", "1") != "0" and available()


def packed_linear(layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x Ŵᵀ + b by the W4A16 kernel for a layer of packed weights (PackedIntLinear, NF4Linear); None
    where it does not run: not a CUDA input of a dtype it takes, or a layout it lacks."""
    if not (use_triton(x) and x.dtype in (torch.float16, torch.bfloat16, torch.float32)):
        return None
    from optkit.kernels.triton import w4a16

    packed = w4a16.packed_for(layer)
    return None if packed is None else w4a16.w4a16_linear(x, packed, bias)


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of the device (split-K and split-KV heuristics aim for a few waves)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: keep grids small
