"""Structure-aware GGUF mutants: a valid file is parsed into its fields (its own small parser, not
optkit's), one to four fields are changed, and the file is written back. What changes: the tensor
and metadata counts, string and array lengths (each may be declared apart from its bytes), value
types (re-encoded, or the type id alone retagged), values (zero, huge, negative, NaN, hostile
strings), keys (duplicated, dropped, added), tensor dims, ggml types, offsets and names,
`general.alignment`, the tensor data (NaN scales, flipped bytes) and where the file ends.

Layout (ggml/docs/gguf.md, little-endian): magic | version u32 | n_tensors u64 | n_kv u64 |
n_kv × (key string, type u32, value) | n_tensors × (name, n_dims u32, dims u64…, type u32, offset
u64) | padding to the alignment | data. A string is a u64 length and its bytes; an array is an item
type u32, a count u64 and the items.
"""

import json
import random
import struct
from dataclasses import dataclass, field

from tests.fuzz import values

SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
INTS, FLOATS = (0, 1, 2, 3, 4, 5, 10, 11), (6, 12)
STRING, ARRAY = 8, 9
# ggml type id -> (values per block, bytes per block): gguf-py's GGML_QUANT_SIZES for what the seeds hold
SIZES = {0: (1, 4), 1: (1, 2), 30: (1, 2), 2: (32, 18), 3: (32, 20), 8: (32, 34)}
READ_KEYS = (  # keys optkit's readers look at ({arch} is the seed's architecture)
    "general.architecture", "general.alignment", "general.name", "general.file_type", "general.quantized_by",
    "{arch}.block_count", "{arch}.context_length", "{arch}.embedding_length", "{arch}.feed_forward_length",
    "{arch}.attention.head_count", "{arch}.attention.head_count_kv", "{arch}.attention.key_length",
    "{arch}.attention.layer_norm_rms_epsilon", "{arch}.rope.freq_base", "{arch}.rope.scaling.type",
    "{arch}.rope.scaling.factor", "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
    "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id", "tokenizer.ggml.add_bos_token", "tokenizer.chat_template", "optkit.manifest",
)  # fmt: skip


@dataclass
class Str:
    raw: bytes
    declared: int | None = None  # the length the file states, when it lies


@dataclass
class Value:
    type: int
    value: object  # a scalar, a Str, or for arrays a list of items of item_type
    item_type: int = 0
    declared: int | None = None  # an array's stated count, when it lies
    raw: bytes | None = None  # bytes written as they are after the type id (a retagged value)


@dataclass
class Tensor:
    name: Str
    dims: list[int]
    type: int
    offset: int
    data: bytes
    n_dims: int | None = None  # the stated number of dims, when it lies


@dataclass
class GGUF:
    arch: str
    version: int
    kvs: list[tuple[Str, Value]]
    tensors: list[Tensor]
    alignment: int  # the padding the data section starts at
    magic: bytes = b"GGUF"
    n_kv: int | None = None  # stated counts, when they lie
    n_tensors: int | None = None
    cut: int | None = None  # the file ends at this byte
    flips: list[tuple[int, int]] = field(default_factory=list)  # (position, xor) over the whole file


def parse(data: bytes) -> GGUF:
    pos = 0

    def take(fmt: str):
        nonlocal pos
        (value,) = struct.unpack_from("<" + fmt, data, pos)
        pos += struct.calcsize(fmt)
        return value

    def string() -> Str:
        nonlocal pos
        n = take("Q")
        pos += n
        return Str(data[pos - n : pos])

    def value(type_id: int) -> Value:
        if type_id in SCALARS:
            return Value(type_id, take(SCALARS[type_id]))
        if type_id == STRING:
            return Value(type_id, string())
        item, count = take("I"), take("Q")
        return Value(type_id, [value(item).value for _ in range(count)], item_type=item)

    assert data[:4] == b"GGUF"
    pos = 4
    version, n_tensors, n_kv = take("I"), take("Q"), take("Q")
    kvs = []
    for _ in range(n_kv):
        key = string()
        kvs.append((key, value(take("I"))))
    infos = []
    for _ in range(n_tensors):
        name = string()
        dims = [take("Q") for _ in range(take("I"))]
        infos.append((name, dims, take("I"), take("Q")))
    found = {k.raw: v.value for k, v in kvs}
    alignment = found.get(b"general.alignment", 32)
    start = -(-pos // alignment) * alignment
    tensors = [
        Tensor(name, dims, kind, offset, data[start + offset : start + offset + nbytes(dims, kind)])
        for name, dims, kind, offset in infos
    ]
    return GGUF(found[b"general.architecture"].raw.decode(), version, kvs, tensors, alignment)


def nbytes(dims: list[int], kind: int) -> int:
    block, size = SIZES.get(kind, (1, 4))
    count = 1
    for d in dims:
        count *= d
    return count // block * size


def serialize(f: GGUF) -> bytes:
    out = bytearray(f.magic + struct.pack("<IQQ", f.version & 0xFFFFFFFF, _count(f.n_tensors, f.tensors), 0))
    out[16:24] = struct.pack("<Q", _count(f.n_kv, f.kvs))
    for key, value in f.kvs:
        out += _string(key) + struct.pack("<I", value.type & 0xFFFFFFFF) + _value(value)
    for t in f.tensors:
        out += _string(t.name) + struct.pack("<I", (len(t.dims) if t.n_dims is None else t.n_dims) & 0xFFFFFFFF)
        out += b"".join(struct.pack("<Q", d & (2**64 - 1)) for d in t.dims)
        out += struct.pack("<IQ", t.type & 0xFFFFFFFF, t.offset & (2**64 - 1))
    out += bytes(-len(out) % max(f.alignment, 1))
    start = len(out)
    for t in f.tensors:
        if t.offset + len(t.data) <= 1 << 22:  # data at an absurd offset is simply not there
            end = start + t.offset + len(t.data)
            out += bytes(max(0, end - len(out)))
            out[start + t.offset : end] = t.data
    for position, xor in f.flips:
        if position < len(out):
            out[position] ^= xor
    return bytes(out[: f.cut] if f.cut is not None else out)


def _count(declared: int | None, items: list) -> int:
    return (len(items) if declared is None else declared) & (2**64 - 1)


def _string(s: Str) -> bytes:
    return struct.pack("<Q", (len(s.raw) if s.declared is None else s.declared) & (2**64 - 1)) + s.raw


def _scalar(type_id: int, v) -> bytes:
    fmt = SCALARS[type_id]
    if type_id in FLOATS:
        x = float(v) if isinstance(v, (int, float)) and abs(v) < 1e300 else float("inf")
        return struct.pack("<" + fmt, x if fmt == "d" or abs(x) < 3.4e38 or x != x else float("inf"))
    if type_id == 7:
        return struct.pack("<B", int(v) & 0xFF if isinstance(v, (int, float)) else 1)
    bits = struct.calcsize(fmt) * 8
    n = int(v) if isinstance(v, (int, float)) and v == v and abs(v) != float("inf") else 0
    n &= (1 << bits) - 1
    if fmt.islower() and n >= 1 << (bits - 1):
        n -= 1 << bits
    return struct.pack("<" + fmt, n)


def _item(type_id: int, v) -> bytes:
    if type_id in SCALARS:
        return _scalar(type_id, v)
    if type_id == STRING:
        return _string(v if isinstance(v, Str) else Str(str(v).encode()))
    if type_id == ARRAY and isinstance(v, Value):  # an array of arrays: each item is (type, count, items)
        return _value(v)
    return b""


def _value(v: Value) -> bytes:
    if v.raw is not None:
        return v.raw
    if v.type == ARRAY:
        items = v.value if isinstance(v.value, list) else []
        head = struct.pack("<IQ", v.item_type & 0xFFFFFFFF, _count(v.declared, items))
        return head + b"".join(_item(v.item_type, i) for i in items)
    return _item(v.type, v.value)


def relayout(f: GGUF, alignment: int | None = None) -> None:
    """Tensors packed in order at aligned offsets, each data resized to what its dims and type need."""
    f.alignment = alignment or f.alignment
    offset = 0
    for t in f.tensors:
        size = nbytes(t.dims, t.type) if all(0 <= d < 1 << 20 for d in t.dims) else len(t.data)
        t.data = (t.data + bytes(max(0, size - len(t.data))))[: min(size, 1 << 20)]
        t.offset = offset
        offset += -(-len(t.data) // f.alignment) * f.alignment


def mutate(seed: bytes, rng: random.Random) -> tuple[bytes, list[str]]:
    """One mutant of `seed` and the names of the mutations applied."""
    f = parse(seed)
    names = []
    for _ in range(rng.choice((1, 1, 1, 2, 2, 3, 4))):
        op = rng.choices(OPERATIONS, weights=[w for _, w in OPERATIONS])[0][0]
        names.append(op(f, rng) or op.__name__)
    return serialize(f), names


def _kv(f: GGUF, rng: random.Random, key: str | None = None) -> tuple[Str, Value]:
    wanted = [kv for kv in f.kvs if key is None or kv[0].raw == key.encode()]
    read = [kv for kv in f.kvs if kv[0].raw.decode("utf-8", "replace") in _read_keys(f)]
    return rng.choice(wanted or f.kvs) if key or rng.random() < 0.3 or not read else rng.choice(read)


def _read_keys(f: GGUF) -> list[str]:
    return [k.format(arch=f.arch) for k in READ_KEYS]


def _new_value(rng: random.Random, type_id: int, old) -> Value:
    """A value of `type_id`, hostile or plausible; strings and arrays keep a tie to `old`."""
    if type_id in INTS:
        return Value(type_id, values.integer(rng))
    if type_id in FLOATS:
        return Value(type_id, values.real(rng))
    if type_id == 7:
        return Value(type_id, rng.choice((0, 1, 2, 255)))
    if type_id == STRING:
        return Value(type_id, Str(values.text_bytes(rng, old.raw if isinstance(old, Str) else b"")))
    item = rng.choice((*INTS, *FLOATS, STRING, STRING, 7, ARRAY))
    count = rng.choice((0, 1, 2, 3, 65, 1000))
    if item == ARRAY:  # arrays of arrays of u32 or strings
        inner = rng.choice((4, STRING))
        return Value(
            ARRAY,
            [Value(ARRAY, [_new_value(rng, inner, None).value], item_type=inner)] * min(count, 3),
            item_type=ARRAY,
        )
    return Value(ARRAY, [_new_value(rng, item, old).value for _ in range(count)], item_type=item)


def set_value(f, rng):
    key, value = _kv(f, rng)
    if value.type == ARRAY and value.value and rng.random() < 0.6:
        i = rng.randrange(len(value.value))
        value.value[i] = _new_value(rng, value.item_type, value.value[i]).value
        return f"set_item:{key.raw.decode(errors='replace')}"
    new = _new_value(rng, value.type, value.value)
    value.value, value.item_type, value.raw = new.value, new.item_type, None
    return f"set_value:{key.raw.decode(errors='replace')}"


def retype(f, rng):
    """The same value re-encoded as another type (u32 -> u64, f32, string, an array of it...)."""
    key, value = _kv(f, rng)
    new_type = rng.choice((*INTS, *FLOATS, 7, STRING, ARRAY))
    old = value.value
    if new_type == ARRAY:
        value.value, value.item_type = [old], value.type
    elif new_type == STRING:
        value.value = Str(repr(old).encode() if not isinstance(old, Str) else old.raw)
    elif isinstance(old, list):
        value.value = old[0] if old and not isinstance(old[0], Str) else len(old)
    elif isinstance(old, Str):
        value.value = len(old.raw)
    value.type, value.raw = new_type, None
    return f"retype:{key.raw.decode(errors='replace')}->{new_type}"


def retag(f, rng):
    """The value's bytes kept, its type id changed: the reader walks the bytes as another type."""
    key, value = _kv(f, rng)
    value.raw = _value(value)
    value.type = rng.choice((*range(13), 13, 255, 2**31))
    return f"retag:{key.raw.decode(errors='replace')}->{value.type}"


def duplicate_kv(f, rng):
    key, value = _kv(f, rng)
    copy = Value(value.type, value.value, value.item_type, value.declared, value.raw)
    if rng.random() < 0.5:
        copy = _new_value(rng, value.type, value.value)
    f.kvs.insert(rng.randrange(len(f.kvs) + 1), (Str(key.raw), copy))


def drop_kv(f, rng):
    key, value = _kv(f, rng)
    f.kvs.remove((key, value))
    return f"drop_kv:{key.raw.decode(errors='replace')}"


def add_kv(f, rng):
    present = {k.raw.decode("utf-8", "replace") for k, _ in f.kvs}
    absent = [k for k in _read_keys(f) if k not in present]
    key = rng.choice(absent if absent and rng.random() < 0.8 else _read_keys(f))
    value = _new_value(rng, rng.choice((*INTS, *FLOATS, STRING, ARRAY)), None)
    if key == "optkit.manifest" and rng.random() < 0.7:
        value = Value(STRING, Str(values.json_text(rng).encode()))
    f.kvs.insert(rng.randrange(len(f.kvs) + 1), (Str(key.encode()), value))
    return f"add_kv:{key}"


def manifest_value(f, rng):
    """optkit.manifest (JSON in a string, shown by `inspect`) as another JSON document."""
    key, value = _kv(f, rng, "optkit.manifest")
    try:
        old = json.loads(value.value.raw)
    except (AttributeError, ValueError):
        old = {}
    value.type, value.raw = STRING, None
    value.value = Str(values.json_text(rng, old).encode())


def architecture(f, rng):
    key, value = _kv(f, rng, "general.architecture")
    value.type, value.raw = STRING, None
    value.value = Str(rng.choice((b"llama", b"qwen2", b"qwen3", b"gemma", b"", b"llama\x00", b"[/]", b"\x1b[2J")))


def lie_count(f, rng):
    which = rng.choice(("n_kv", "n_tensors"))
    true = len(f.kvs if which == "n_kv" else f.tensors)
    setattr(f, which, rng.choice((0, true - 1, true + 1, true + 2, 2**32, 2**40, 2**63, 2**64 - 1)))
    return f"lie_count:{which}"


def lie_length(f, rng):
    strings = [k for k, _ in f.kvs] + [t.name for t in f.tensors]
    strings += [v.value for _, v in f.kvs if isinstance(v.value, Str)]
    strings += [i for _, v in f.kvs if v.type == ARRAY for i in v.value if isinstance(i, Str)][:50]
    s = rng.choice(strings)
    s.declared = rng.choice((0, len(s.raw) - 1, len(s.raw) + 1, len(s.raw) + 8, 2**31, 2**40, 2**63, 2**64 - 1))


def array_count(f, rng):
    arrays = [v for _, v in f.kvs if v.type == ARRAY]
    if not arrays:
        return "array_count:none"
    a = rng.choice(arrays)
    n = len(a.value)
    if rng.random() < 0.15:  # many small items: the reader's per-item cost
        a.value, a.item_type = [Str(b"")] * rng.choice((10_000, 100_000)), STRING
        return "array_count:many"
    a.declared = rng.choice((0, n - 1, n + 1, n * 2, 2**32, 2**40, 2**62, 2**64 - 1))


def array_item_type(f, rng):
    arrays = [v for _, v in f.kvs if v.type == ARRAY]
    if arrays:
        rng.choice(arrays).item_type = rng.choice((*range(13), 13, 255))


def _tensor(f, rng) -> Tensor:
    return rng.choice(f.tensors)


def tensor_dims(f, rng):
    t = _tensor(f, rng)
    what = rng.random()
    if what < 0.5:
        i = rng.randrange(len(t.dims))
        t.dims[i] = rng.choice((0, 1, 16, 31, 33, 64, 2**31, 2**32, 2**62, 2**63, 2**64 - 1))
    elif what < 0.75:
        t.dims = t.dims + [1] * rng.choice((1, 2, 3, 61, 64)) if rng.random() < 0.5 else t.dims[:1] * 0
    else:
        t.n_dims = rng.choice((0, len(t.dims) + 1, 5, 65, 2**31, 2**32 - 1))
    if rng.random() < 0.5:
        relayout(f)


def tensor_type(f, rng):
    t = _tensor(f, rng)
    t.type = rng.choice((0, 1, 2, 3, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 29, 30, 31, 39, 40, 41, 255, 2**31))
    if rng.random() < 0.5:
        relayout(f)


def tensor_offset(f, rng):
    t = _tensor(f, rng)
    other = _tensor(f, rng)
    t.offset = rng.choice((t.offset + 1, t.offset + 4, other.offset, t.offset + (1 << 20), 2**40, 2**63, 2**64 - 32))


def tensor_name(f, rng):
    t = _tensor(f, rng)
    t.name = Str(rng.choice(
        (_tensor(f, rng).name.raw, b"", b"[/]", b"[bold red]x", b"\x1b]0;pwn\x07", b"\xff\xfe", b"blk.99.attn_q.weight",
         b"blk.x.attn_q.weight", b"blk.-1.attn_q.weight", b"rope_freqs.weight", b"a" * 300, t.name.raw + b"\x00")
    ))  # fmt: skip


def drop_tensor(f, rng):
    t = _tensor(f, rng)
    f.tensors.remove(t)
    if rng.random() < 0.5:
        relayout(f)
    return f"drop_tensor:{t.name.raw.decode(errors='replace')}"


def duplicate_tensor(f, rng):
    t = _tensor(f, rng)
    f.tensors.append(Tensor(Str(t.name.raw), list(t.dims), t.type, t.offset, t.data))
    if rng.random() < 0.5:
        relayout(f)


def alignment(f, rng):
    """general.alignment set (as u32 or another type), the data relaid to it or not."""
    new = rng.choice((0, 1, 2, 3, 8, 16, 24, 64, 4096, 2**31, 2**32, 2**63))
    kind = rng.choice((4, 4, 4, 10, 5, 6, 8))
    f.kvs = [kv for kv in f.kvs if kv[0].raw != b"general.alignment"]
    f.kvs.insert(
        rng.randrange(len(f.kvs) + 1), (Str(b"general.alignment"), Value(kind, new if kind != 8 else Str(b"32")))
    )
    if kind in (4, 10) and 0 < new <= 4096 and not new & (new - 1) and rng.random() < 0.7:
        relayout(f, new)
    return f"alignment:{new}:{kind}"


def poison_data(f, rng):
    """NaN or inf in a float tensor or in a quantized block's fp16 scale."""
    t = _tensor(f, rng)
    if not t.data:
        return "poison_data:empty"
    data = bytearray(t.data)
    pattern = rng.choice((b"\x00\x7e", b"\x00\x7c", b"\x00\x00\xc0\x7f", b"\xff\xff\xff\xff"))
    position = 0 if t.type in (2, 3, 8) else rng.randrange(0, max(1, len(data) - len(pattern)))
    data[position : position + len(pattern)] = pattern
    t.data = bytes(data[: len(t.data)])


def flip_bytes(f, rng):
    size = len(serialize(f))
    f.flips += [(rng.randrange(size), 1 << rng.randrange(8)) for _ in range(rng.choice((1, 2, 8)))]


def truncate(f, rng):
    size = len(serialize(f))
    f.cut = rng.choice((rng.randrange(24, size), size - 1, size - rng.randrange(1, 64), rng.randrange(24, 2048)))


def version(f, rng):
    f.version = rng.choice((0, 1, 2, 4, 2**31, 2**32 - 1))


OPERATIONS = (
    (set_value, 14), (retype, 8), (retag, 4), (duplicate_kv, 4), (drop_kv, 6), (add_kv, 5), (manifest_value, 3),
    (architecture, 2), (lie_count, 3), (lie_length, 4), (array_count, 4), (array_item_type, 2), (tensor_dims, 8),
    (tensor_type, 5), (tensor_offset, 4), (tensor_name, 4), (drop_tensor, 3), (duplicate_tensor, 2),
    (alignment, 4), (poison_data, 4), (flip_bytes, 2), (truncate, 3), (version, 1),
)  # fmt: skip
