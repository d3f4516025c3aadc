"""A .gguf's tensor data as numpy arrays over a memory map of the file, shaped as gguf-py's reader
shapes them: float and integer types as their dtype in row-major order ([ne1, ne0]), block types as
bytes ([ne1, ne0 / block_size · type_size]). Only for a header whose layout checks out
(gguf_check.layout_problems): every tensor's bytes are then inside the file."""

from collections.abc import Iterator

import numpy as np

from optkit.quant.formats.gguf_header import Header, TensorInfo

# ggml type id -> numpy dtype, for the types stored as plain numbers (BF16 is read as bytes, as gguf-py does)
PLAIN = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}


def type_name(type_id: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return f"type {type_id}"


def sizes() -> dict[int, tuple[int, int]]:
    """ggml type id -> (values per block, bytes per block)."""
    from gguf import GGML_QUANT_SIZES

    return {int(t): v for t, v in GGML_QUANT_SIZES.items()}


def byte_count(info: TensorInfo) -> int:
    block, size = sizes()[info.type_id]
    return info.elements // block * size


def tensor_arrays(header: Header) -> Iterator[tuple[TensorInfo, np.ndarray]]:
    """(info, data) for every tensor, read lazily from one memory map."""
    if not header.tensors:
        return
    whole = np.memmap(header.path, dtype=np.uint8, mode="r")
    table = sizes()
    for info in header.tensors:
        block, size = table[info.type_id]
        start = header.data_start + info.offset
        raw = whole[start : start + info.elements // block * size]
        rows = tuple(reversed(info.dims[1:]))
        if info.type_id in PLAIN:
            yield info, raw.view(PLAIN[info.type_id]).reshape(*rows, info.dims[0])
        else:
            yield info, raw.reshape(*rows, info.dims[0] // block * size)
