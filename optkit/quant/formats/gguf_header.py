"""A .gguf's header, walked byte by byte with every count and length bounded before anything is
allocated from it, so that a broken or hostile file gets one line naming what is wrong (gguf-py's
reader answers "cannot reshape array of size 6", allocates from counts it has not checked, and
costs ~1.5 KiB per string: 1.5 GiB for a header of a million empty strings).

The layout (ggml/docs/gguf.md, little-endian):
  magic "GGUF" | version u32 | tensor_count u64 | kv_count u64
  kv_count × (key: string, value_type u32, value)      string = u64 length + UTF-8 bytes
                                                        array  = item type u32, count u64, items
  tensor_count × (name: string, n_dims u32, dims u64[n_dims], ggml type u32, offset u64)
  padding to `general.alignment` (a u32, default 32), then the tensor data; offsets count from there.
A tensor of ggml type T and dims [ne0, ne1, …] (ne0 the row length, fastest-varying) holds
ne0·ne1·… / block_size(T) blocks of type_size(T) bytes, and ne0 must be whole blocks.
What ggml's gguf.cpp refuses is refused here too: nested arrays, a key twice, more than 4 dims,
an element count that overflows int64, an alignment that is not a u32 power of two.
"""

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from optkit.errors import OptkitError

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # what llama.cpp reads today (version 1 used 32-bit counts)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
# value type id -> struct format of one scalar (8: string, 9: array)
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY, UINT32 = 8, 9, 4
TYPE_NAMES = {0: "u8", 1: "i8", 2: "u16", 3: "i16", 4: "u32", 5: "i32", 6: "f32", 7: "bool", 8: "string"}
TYPE_NAMES |= {9: "array", 10: "u64", 11: "i64", 12: "f64"}
INTEGERS = frozenset((0, 1, 2, 3, 4, 5, 10, 11))
# bounds far above any real model's (tens of keys, thousands of tensors, a 262k vocabulary, a
# chat template of some KiB) and far below what would exhaust a machine
MAX_KEYS = 1 << 16
MAX_TENSORS = 1 << 20
MAX_ITEMS = 1 << 24
# array items over the whole header: a 262k vocabulary's tokens, scores, types and merges are ~1.3M;
# each string costs ~60 bytes of memory for ~10 of file, so a count bounded by the file alone is not enough
MAX_HEADER_ITEMS = 1 << 22
MAX_STRING = 1 << 24
SMALLEST_KV = 8 + 4 + 1  # key length, value type, a u8
SMALLEST_TENSOR_INFO = 8 + 4 + 4 + 8  # name length, n_dims, type, offset


@dataclass(frozen=True)
class Entry:
    type_id: int
    value: object  # int, float, bool, str; an array: list[str] or a 1-D numpy array
    item_type: int | None = None  # an array's

    def describe(self) -> str:
        if self.type_id == ARRAY:
            return f"an array of {TYPE_NAMES.get(self.item_type, self.item_type)}"
        return f"a {TYPE_NAMES[self.type_id]}"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF order: ne0 (row length) first
    type_id: int
    offset: int  # from the start of the data section

    @property
    def elements(self) -> int:
        count = 1
        for dim in self.dims:
            count *= dim
        return count


@dataclass(frozen=True)
class Header:
    path: Path
    version: int
    alignment: int
    data_start: int  # absolute byte offset of the data section
    file_size: int
    metadata: dict[str, Entry]
    tensors: tuple[TensorInfo, ...]

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(self.metadata)

    def value(self, key: str, default=None):
        entry = self.metadata.get(key)
        return default if entry is None else entry.value


class _Cursor:
    def __init__(self, data, path: Path):
        self.data, self.pos, self.path = data, 0, path
        self.where = "the header"
        self.items = 0  # array items read so far, against MAX_HEADER_ITEMS

    def fail(self, what: str) -> OptkitError:
        return OptkitError(f"{self.path}: {what} in {self.where}: the header is corrupted")

    def truncated(self, end: int) -> OptkitError:
        return OptkitError(
            f"{self.path}: truncated in {self.where} (byte {end:,} of {len(self.data):,}): "
            "the file is incomplete, copy or download it again"
        )

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise self.truncated(self.pos + n)
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def unpack(self, fmt: str):
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt)))[0]

    def count(self, limit: int, smallest: int, what: str) -> int:
        """A u64 count of things of at least `smallest` bytes each, bounded by `limit` and by the bytes left."""
        n = self.unpack("Q")
        if n > limit:
            raise self.fail(f"{what} {n:,} (at most {limit:,})")
        if limit == MAX_ITEMS:  # an array: the header's items together are bounded too
            self.items += n
            if self.items > MAX_HEADER_ITEMS:
                raise self.fail(f"{self.items:,} array items in all (at most {MAX_HEADER_ITEMS:,})")
        if self.pos + n * smallest > len(self.data):
            raise self.truncated(self.pos + n * smallest)
        return n

    def string(self) -> str:
        raw = self.take(self.count(MAX_STRING, 1, "a string of length"))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail("a string that is not UTF-8") from None

    def value(self, type_id: int) -> Entry:
        if type_id in SCALARS:
            return Entry(type_id, self.unpack(SCALARS[type_id]))
        if type_id == STRING:
            return Entry(type_id, self.string())
        if type_id != ARRAY:
            raise self.fail(f"unknown value type {type_id}")
        item = self.unpack("I")
        if item in SCALARS:
            width = struct.calcsize(SCALARS[item])
            n = self.count(MAX_ITEMS, width, "an array of")
            dtype = np.dtype("<" + SCALARS[item]) if item != 7 else np.dtype(np.bool_)
            return Entry(ARRAY, np.frombuffer(self.take(n * width), dtype=dtype).copy(), item)
        if item == STRING:
            return Entry(ARRAY, self.strings(self.count(MAX_ITEMS, 8, "an array of")), item)
        raise self.fail(f"an array of value type {item} (nested arrays are not GGUF llama.cpp reads)")

    def strings(self, n: int) -> list[str]:
        """n strings; the loop is the one place a header can hold a million things, so it is kept tight."""
        data, pos, end, unpack = self.data, self.pos, len(self.data), struct.unpack_from
        out = []
        for i in range(n):
            if pos + 8 > end:
                self.pos = pos
                self.take(8)
            length = unpack("<Q", data, pos)[0]
            pos += 8
            if length > MAX_STRING or pos + length > end:
                self.pos, self.where = pos, f"{self.where}, item {i}"
                if length > MAX_STRING:
                    raise self.fail(f"a string of length {length:,} (at most {MAX_STRING:,})")
                raise self.truncated(pos + length)
            try:
                out.append(str(data[pos : pos + length], "utf-8"))
            except UnicodeDecodeError:
                self.where = f"{self.where}, item {i}"
                raise self.fail("a string that is not UTF-8") from None
            pos += length
        self.pos = pos
        return out


def read_header(path: str | Path) -> Header:
    """The header's structure and metadata, or an OptkitError naming the first thing wrong (not a
    GGUF file, an unsupported version, truncated, corrupted, a count that cannot fit the file)."""
    path = Path(path)
    if not path.is_file():
        raise OptkitError(f"{path} is not a file: give the path of a .gguf")
    size = path.stat().st_size
    data = path.read_bytes() if size < 1 << 16 else _head(path)
    cursor = _Cursor(data, path)
    magic = bytes(data[:4])
    if magic != MAGIC:
        raise OptkitError(f"{path} is not a GGUF file: it starts with {magic!r}, not {MAGIC!r}")
    cursor.take(4)
    version = cursor.unpack("I")
    if version not in VERSIONS:
        raise OptkitError(f"{path}: GGUF version {version}; llama.cpp and optkit read versions 2 and 3")
    cursor.where = "the counts"
    n_tensors = cursor.count(MAX_TENSORS, SMALLEST_TENSOR_INFO, "a tensor count of")
    n_kv = cursor.count(MAX_KEYS, SMALLEST_KV, "a metadata count of")
    metadata: dict[str, Entry] = {}
    for i in range(n_kv):
        cursor.where = f"metadata entry {i + 1} of {n_kv}"
        key = cursor.string()
        cursor.where = f"metadata {key!r}"
        if key in metadata:
            raise OptkitError(f"{path}: metadata key {key!r} appears twice (entry {i + 1}): the header is corrupted")
        metadata[key] = cursor.value(cursor.unpack("I"))
    alignment = _alignment(metadata, path)
    tensors = [_tensor_info(cursor, i, n_tensors) for i in range(n_tensors)]
    data_start = -(-cursor.pos // alignment) * alignment
    return Header(path, version, alignment, data_start, size, metadata, tuple(tensors))


def _alignment(metadata: dict[str, Entry], path: Path) -> int:
    entry = metadata.get("general.alignment")
    if entry is None:
        return DEFAULT_ALIGNMENT
    if entry.type_id != UINT32:
        raise OptkitError(f"{path}: general.alignment is {entry.describe()}, not a u32: llama.cpp refuses the file")
    if entry.value <= 0 or entry.value & (entry.value - 1):
        raise OptkitError(f"{path}: general.alignment {entry.value} is not a power of two: corrupted header")
    return entry.value


def _tensor_info(cursor: _Cursor, i: int, n_tensors: int) -> TensorInfo:
    cursor.where = f"tensor info {i + 1} of {n_tensors}"
    name = cursor.string()
    cursor.where = f"tensor info {i + 1} of {n_tensors} ({name!r})"
    n_dims = cursor.unpack("I")
    if n_dims > MAX_DIMS:
        raise cursor.fail(f"{n_dims} dimensions (ggml tensors have at most {MAX_DIMS})")
    dims = tuple(cursor.unpack("Q") for _ in range(n_dims))
    info = TensorInfo(name, dims, cursor.unpack("I"), cursor.unpack("Q"))
    if any(d >= 1 << 63 for d in dims) or info.elements >= 1 << 63:
        raise cursor.fail(f"dimensions {' x '.join(map(str, dims))} overflow int64")
    return info


def _head(path: Path):
    """The file as a memory map, read only where the walk goes (the tensor data is never touched)."""
    import mmap

    with path.open("rb") as f:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def tensor_bytes(info: TensorInfo, sizes: dict[int, tuple[int, int]]) -> int | str:
    """The bytes `info` occupies by its type and shape, or why that cannot be computed.
    sizes: ggml type id -> (block_size, type_size), as gguf.GGML_QUANT_SIZES holds them."""
    if info.type_id not in sizes:
        return f"unknown ggml type {info.type_id}"
    block, size = sizes[info.type_id]
    if not info.dims or info.dims[0] % block:
        return f"rows of {info.dims[0] if info.dims else 0} values are not whole blocks of {block}"
    return info.elements // block * size
