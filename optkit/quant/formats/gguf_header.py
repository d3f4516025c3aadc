"""A .gguf's structure, walked byte by byte before gguf-py's reader sees it, so that a broken file
gets one line naming what is wrong (gguf-py answers "cannot reshape array of size 6" or an
IndexError for a truncated file).

The layout (ggml/docs/gguf.md, little-endian):
  magic "GGUF" | version u32 | tensor_count u64 | kv_count u64
  kv_count × (key: string, value_type u32, value)      string = u64 length + UTF-8 bytes
                                                        array  = item type u32, count u64, items
  tensor_count × (name: string, n_dims u32, dims u64[n_dims], ggml type u32, offset u64)
  padding to `general.alignment` (default 32), then the tensor data; each offset counts from there.
A tensor of ggml type T and dims [ne0, ne1, …] (ne0 the row length, fastest-varying) holds
ne0·ne1·… / block_size(T) blocks of type_size(T) bytes, and ne0 must be whole blocks.
"""

import struct
from dataclasses import dataclass
from pathlib import Path

from optkit.errors import OptkitError

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # what llama.cpp reads today (version 1 used 32-bit counts)
DEFAULT_ALIGNMENT = 32
# value type id -> struct format of one scalar (8: string, 9: array)
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF order: ne0 (row length) first
    type_id: int
    offset: int  # from the start of the data section


@dataclass(frozen=True)
class Header:
    version: int
    alignment: int
    data_start: int  # absolute byte offset of the data section
    file_size: int
    keys: tuple[str, ...]
    tensors: tuple[TensorInfo, ...]


class _Cursor:
    def __init__(self, data: bytes, path: Path):
        self.data, self.pos, self.path = data, 0, path
        self.where = "the header"

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise OptkitError(
                f"{self.path}: truncated in {self.where} (byte {self.pos + n:,} of {len(self.data):,}): "
                "the file is incomplete, copy or download it again"
            )
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def unpack(self, fmt: str):
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        raw = self.take(self.unpack("Q"))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise OptkitError(f"{self.path}: a string in {self.where} is not UTF-8: the header is corrupted") from e

    def value(self, type_id: int):
        """Read (scalars, strings) or skip (arrays) one value; returns scalars and strings."""
        if type_id in SCALARS:
            return self.unpack(SCALARS[type_id])
        if type_id == STRING:
            return self.string()
        if type_id == ARRAY:
            item, count = self.unpack("I"), self.unpack("Q")
            if item in SCALARS:
                self.take(count * struct.calcsize(SCALARS[item]))
            elif item == STRING:
                for _ in range(count):
                    self.take(self.unpack("Q"))
            else:
                raise OptkitError(f"{self.path}: array of unknown value type {item} in {self.where}: corrupted header")
            return None
        raise OptkitError(f"{self.path}: unknown value type {type_id} in {self.where}: the header is corrupted")


def read_header(path: str | Path) -> Header:
    """The header's structure, or an OptkitError naming the first thing wrong (not a GGUF file,
    an unsupported version, truncated, corrupted)."""
    path = Path(path)
    if not path.is_file():
        raise OptkitError(f"{path} is not a file: give the path of a .gguf")
    data = path.read_bytes() if path.stat().st_size < 1 << 16 else _head(path)
    cursor = _Cursor(data, path)
    magic = data[:4]
    if magic != MAGIC:
        raise OptkitError(f"{path} is not a GGUF file: it starts with {magic!r}, not {MAGIC!r}")
    cursor.take(4)
    version = cursor.unpack("I")
    if version not in VERSIONS:
        raise OptkitError(f"{path}: GGUF version {version}; llama.cpp and optkit read versions 2 and 3")
    n_tensors, n_kv = cursor.unpack("Q"), cursor.unpack("Q")
    keys, alignment = [], DEFAULT_ALIGNMENT
    for i in range(n_kv):
        cursor.where = f"metadata entry {i + 1} of {n_kv}"
        key = cursor.string()
        cursor.where = f"metadata {key!r}"
        value = cursor.value(cursor.unpack("I"))
        if key == "general.alignment":
            alignment = value
        keys.append(key)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise OptkitError(f"{path}: general.alignment {alignment!r} is not a power of two: corrupted header")
    tensors = []
    for i in range(n_tensors):
        cursor.where = f"tensor info {i + 1} of {n_tensors}"
        name = cursor.string()
        dims = tuple(cursor.unpack("Q") for _ in range(cursor.unpack("I")))
        tensors.append(TensorInfo(name, dims, cursor.unpack("I"), cursor.unpack("Q")))
    data_start = -(-cursor.pos // alignment) * alignment
    return Header(version, alignment, data_start, path.stat().st_size, tuple(keys), tuple(tensors))


def _head(path: Path) -> bytes:
    """The header's bytes without the tensor data: a memory map, read only where the walk goes."""
    import mmap

    with path.open("rb") as f:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # type: ignore[return-value]


def tensor_bytes(info: TensorInfo, sizes: dict[int, tuple[int, int]]) -> int | str:
    """The bytes `info` occupies by its type and shape, or why that cannot be computed.
    sizes: ggml type id -> (block_size, type_size), as gguf.GGML_QUANT_SIZES holds them."""
    if info.type_id not in sizes:
        return f"unknown ggml type {info.type_id}"
    block, size = sizes[info.type_id]
    count = 1
    for dim in info.dims:
        count *= dim
    if not info.dims or info.dims[0] % block:
        return f"rows of {info.dims[0] if info.dims else 0} values are not whole blocks of {block}"
    return count // block * size
