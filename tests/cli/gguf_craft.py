"""A GGUF writer that can write what no honest writer would: raw struct packing of every field, so
a test can give a count, a type, a length or a value any bytes it likes.

`tiny_llama()` is a valid one-block Llama (a 256-token byte-level vocabulary, F32 weights) that
llama.cpp loads; each crafted file is it with one field changed."""

import struct
from dataclasses import dataclass, field

import numpy as np

U32, I32, F32, BOOL, STRING, ARRAY, U64 = 4, 5, 6, 7, 8, 9, 10
GGML_F32 = 0
WIDTH, HEADS, FFN, VOCAB = 16, 2, 32, 256


def string(raw: bytes | str) -> bytes:
    raw = raw.encode() if isinstance(raw, str) else raw
    return struct.pack("<Q", len(raw)) + raw


def scalar(type_id: int, value) -> bytes:
    fmt = {U32: "I", I32: "i", F32: "f", BOOL: "?", U64: "Q"}[type_id]
    return struct.pack("<I", type_id) + struct.pack("<" + fmt, value)


def text(value: bytes | str) -> bytes:
    return struct.pack("<I", STRING) + string(value)


def strings(items: list) -> bytes:
    return struct.pack("<IIQ", ARRAY, STRING, len(items)) + b"".join(map(string, items))


def numbers(type_id: int, values: list) -> bytes:
    fmt = {U32: "I", I32: "i", F32: "f"}[type_id]
    return struct.pack("<IIQ", ARRAY, type_id, len(values)) + struct.pack(f"<{len(values)}{fmt}", *values)


def byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode alphabet: a token for every byte, so llama.cpp tokenizes any text."""
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    codes, extra = {}, 0
    for b in range(256):
        if b in printable:
            codes[b] = b
        else:
            codes[b] = 256 + extra
            extra += 1
    return [chr(codes[b]) for b in range(256)]


@dataclass
class Tensor:
    name: bytes | str
    dims: tuple[int, ...]  # GGUF order: row length first
    data: bytes = b""
    type_id: int = GGML_F32


@dataclass
class Crafted:
    metadata: dict[bytes | str, bytes] = field(default_factory=dict)  # key -> type id and value, packed
    extra_metadata: list[tuple[bytes | str, bytes]] = field(default_factory=list)  # written after (a key twice)
    tensors: list[Tensor] = field(default_factory=list)
    raw_tensor_infos: bytes | None = None  # replaces the packed tensor infos (dims no writer allows)
    n_tensors: int | None = None
    n_kv: int | None = None

    def write(self, path) -> None:
        entries = [*self.metadata.items(), *self.extra_metadata]
        infos, data, offset = b"", b"", 0
        for t in self.tensors:
            infos += string(t.name) + struct.pack("<I", len(t.dims)) + struct.pack(f"<{len(t.dims)}Q", *t.dims)
            infos += struct.pack("<IQ", t.type_id, offset)
            padded = t.data + b"\0" * (-len(t.data) % 32)
            data += padded
            offset += len(padded)
        if self.raw_tensor_infos is not None:
            infos = self.raw_tensor_infos
        n_tensors = len(self.tensors) if self.n_tensors is None else self.n_tensors
        n_kv = len(entries) if self.n_kv is None else self.n_kv
        head = b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv)
        head += b"".join(string(k) + v for k, v in entries) + infos
        path.write_bytes(head + b"\0" * (-len(head) % 32) + data)


def _weights(rng, *dims: int) -> bytes:
    return (rng.standard_normal(int(np.prod(dims))) * 0.05).astype(np.float32).tobytes()


def tiny_llama() -> Crafted:
    rng = np.random.default_rng(0)
    metadata = {
        "general.architecture": text("llama"),
        "general.name": text("tiny"),
        "llama.context_length": scalar(U32, 64),
        "llama.embedding_length": scalar(U32, WIDTH),
        "llama.block_count": scalar(U32, 1),
        "llama.feed_forward_length": scalar(U32, FFN),
        "llama.attention.head_count": scalar(U32, HEADS),
        "llama.attention.head_count_kv": scalar(U32, HEADS),
        "llama.attention.layer_norm_rms_epsilon": scalar(F32, 1e-5),
        "llama.rope.dimension_count": scalar(U32, WIDTH // HEADS),
        "tokenizer.ggml.model": text("gpt2"),
        "tokenizer.ggml.pre": text("default"),
        "tokenizer.ggml.tokens": strings(byte_tokens()),
        "tokenizer.ggml.token_type": numbers(I32, [1] * VOCAB),
        "tokenizer.ggml.merges": strings([]),
        "tokenizer.ggml.bos_token_id": scalar(U32, 1),
        "tokenizer.ggml.eos_token_id": scalar(U32, 2),
        "tokenizer.chat_template": text("{% for m in messages %}{{ m['content'] }}{% endfor %}"),
    }
    ones = np.ones(WIDTH, dtype=np.float32).tobytes()
    tensors = [
        Tensor("token_embd.weight", (WIDTH, VOCAB), _weights(rng, VOCAB, WIDTH)),
        Tensor("output_norm.weight", (WIDTH,), ones),
    ]
    block = {
        "attn_norm": (WIDTH,),
        "attn_q": (WIDTH, WIDTH),
        "attn_k": (WIDTH, WIDTH),
        "attn_v": (WIDTH, WIDTH),
        "attn_output": (WIDTH, WIDTH),
        "ffn_norm": (WIDTH,),
        "ffn_gate": (WIDTH, FFN),
        "ffn_up": (WIDTH, FFN),
        "ffn_down": (FFN, WIDTH),
    }
    for name, dims in block.items():
        data = ones if len(dims) == 1 else _weights(rng, *dims)
        tensors.append(Tensor(f"blk.0.{name}.weight", dims, data))
    return Crafted(metadata=metadata, tensors=tensors)
