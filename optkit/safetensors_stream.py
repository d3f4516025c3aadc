"""Write a safetensors file one tensor at a time, so that a checkpoint never has to be in memory.

The layout (https://huggingface.co/docs/safetensors): an 8-byte little-endian header length N,
N bytes of JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}
padded with spaces to a multiple of 8, then the tensors' bytes back to back. Tensors are laid out
as the reference writer (safetensors' `save_file`) lays them out, by dtype in the order below, then
by name: the same bytes as `save_file` for the same tensors, and every tensor starts at a multiple
of its element size, so loaders can map it in place.
"""

import json
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from optkit.errors import OptkitError

# In the reference writer's data order (the reverse of its Dtype enum): sizes never increase.
DTYPE_NAMES = {
    torch.int64: "I64",
    torch.float64: "F64",
    torch.float32: "F32",
    torch.int32: "I32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int16: "I16",
    torch.float8_e4m3fn: "F8_E4M3",  # FP8 W8A8 weights
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_RANK = {dtype: rank for rank, dtype in enumerate(DTYPE_NAMES)}
DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


@dataclass(frozen=True)
class LazyTensor:
    """A tensor known by dtype and shape, read only when written."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    load: Callable[[], torch.Tensor]

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "LazyTensor":
        return cls(tensor.dtype, tuple(tensor.shape), lambda: tensor)

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.dtype.itemsize


def lazy_tensors_in(file: Path) -> dict[str, LazyTensor]:
    """Every tensor of a safetensors file, from its header alone."""

    def loader(key: str) -> Callable[[], torch.Tensor]:
        def load() -> torch.Tensor:
            with safe_open(file, framework="pt") as f:
                return f.get_tensor(key)

        return load

    tensors = {}
    try:
        with safe_open(file, framework="pt") as f:
            specs = {key: (f.get_slice(key).get_dtype(), tuple(f.get_slice(key).get_shape())) for key in f.keys()}
    except (SafetensorError, OSError) as e:
        raise OptkitError(f"{file} is truncated or corrupt ({e}): re-create or re-download it") from e
    for key, (dtype, shape) in specs.items():
        if dtype not in DTYPES:
            raise OptkitError(f"{file}: tensor {key} is {dtype}, which optkit cannot copy: give a bf16/fp16/fp32 model")
        tensors[key] = LazyTensor(DTYPES[dtype], shape, loader(key))
    return tensors


def write_safetensors(
    path: Path,
    tensors: Mapping[str, LazyTensor | torch.Tensor],
    metadata: dict[str, str] | None = None,
    on_written: Callable[[str, int], None] | None = None,
) -> None:
    """Write `tensors` to `path`; at most one of them is loaded at a time. `on_written(name,
    nbytes)` is called after each tensor (for a progress bar)."""
    lazy = {name: t if isinstance(t, LazyTensor) else LazyTensor.of(t) for name, t in tensors.items()}
    for name, spec in lazy.items():
        if spec.dtype not in DTYPE_NAMES:
            raise ValueError(f"{name}: dtype {spec.dtype} has no safetensors name")
    order = sorted(lazy, key=lambda name: (_RANK[lazy[name].dtype], name))
    header: dict[str, dict] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in order:
        spec = lazy[name]
        header[name] = {
            "dtype": DTYPE_NAMES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for name in order:
            spec = lazy[name]
            tensor = spec.load().detach().to("cpu").contiguous()
            if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
                raise ValueError(
                    f"{name}: announced {spec.dtype} {list(spec.shape)}, got {tensor.dtype} {list(tensor.shape)}"
                )
            if tensor.numel():
                f.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
            del tensor
            if on_written is not None:
                on_written(name, spec.nbytes)
