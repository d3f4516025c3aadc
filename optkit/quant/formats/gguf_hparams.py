"""A .gguf's hyperparameters and vocabulary checked against what the architecture allows, before
llama.cpp or optkit's runtime sees them: the types llama.cpp's loader reads (llama-model.cpp
load_hparams, llama-vocab.cpp load: a u32 where it reads a u32, an f32 where it reads a float),
positive sizes under sane bounds, heads that divide, arrays as long as the vocabulary they
describe (llama.cpp indexes scores and token types by token id without checking)."""

import json
import math

from optkit.errors import OptkitError
from optkit.families import gguf_architectures
from optkit.quant.formats.gguf_header import ARRAY, INTEGERS, STRING, Entry, Header

MAX_LAYERS = 512  # LLAMA_MAX_LAYERS
MAX_WIDTH = 1 << 20
MAX_HEAD_DIM = 1 << 16
U32, I32, F32 = 4, 5, 6
# {arch}.KEY -> (required, the largest value): u32 sizes llama.cpp reads for these architectures
SIZES = {
    "block_count": (True, MAX_LAYERS),
    "context_length": (True, (1 << 32) - 1),
    "embedding_length": (True, MAX_WIDTH),
    "feed_forward_length": (True, MAX_WIDTH),
    "attention.head_count": (True, MAX_WIDTH),
    "attention.head_count_kv": (False, MAX_WIDTH),
    "attention.key_length": (False, MAX_HEAD_DIM),
    "attention.value_length": (False, MAX_HEAD_DIM),
    "rope.dimension_count": (False, MAX_HEAD_DIM),
}
PER_LAYER = ("feed_forward_length", "attention.head_count", "attention.head_count_kv")  # a u32 or one per layer
POSITIVE_FLOATS = ("attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.scaling.factor")
COMMON_SIZES = ("context_length", "embedding_length", "block_count")  # any architecture's
SPECIAL_IDS = ("bos", "eos", "unknown", "seperator", "padding", "eot", "eom")  # sic: llama.cpp's key


def written_architectures() -> tuple[str, ...]:
    """The llama.cpp architectures optkit writes (its families name them)."""
    return tuple(dict.fromkeys(arch.name for arch in gguf_architectures().values()))


def architecture(header: Header) -> str | None:
    """general.architecture when it is a string, else None (metadata_value_problems names why)."""
    entry = header.metadata.get("general.architecture")
    return entry.value if entry is not None and entry.type_id == STRING else None


def layer_values(header: Header, key: str) -> list[int] | None:
    """A size that may be given per layer, as one value per layer (None when absent)."""
    entry = header.metadata.get(key)
    if entry is None:
        return None
    if entry.type_id == ARRAY:
        return [int(v) for v in entry.value]
    return [int(entry.value)] * _int(header, f"{architecture(header)}.block_count")


def _int(header: Header, key: str, default: int = 0) -> int:
    value = header.value(key, default)
    return int(value) if isinstance(value, int) else default


def metadata_value_problems(header: Header) -> list[str]:
    """Each value that llama.cpp would refuse, crash on, or read out of bounds, named in one line."""
    entry = header.metadata.get("general.architecture")
    if entry is not None and entry.type_id != STRING:
        return [f"general.architecture is {entry.describe()}, not a string: llama.cpp cannot tell the model"]
    arch = architecture(header)
    problems = []
    sizes = SIZES if arch in written_architectures() else {k: SIZES[k] for k in COMMON_SIZES}
    for name, (_, largest) in sizes.items():
        key = f"{arch}.{name}"
        if key in header.metadata:
            problems += _size_problems(header, key, header.metadata[key], largest, name in PER_LAYER)
    if arch in written_architectures():
        for name in POSITIVE_FLOATS:
            key = f"{arch}.{name}"
            if key in header.metadata:
                problems += _float_problems(key, header.metadata[key])
    if problems:
        return problems
    if arch in written_architectures():
        problems += _head_problems(header, arch)
    return problems + vocabulary_problems(header) + manifest_problems(header)


def _size_problems(header: Header, key: str, entry: Entry, largest: int, per_layer: bool) -> list[str]:
    if per_layer and entry.type_id == ARRAY and entry.item_type in (U32, I32):
        values = [int(v) for v in entry.value]
        layers = _int(header, f"{architecture(header)}.block_count")
        if len(values) != layers:
            return [f"{key} gives {len(values)} values for {layers} layers"]
    elif entry.type_id != U32:
        return [f"{key} is {entry.describe()}; llama.cpp reads a u32"]
    else:
        values = [entry.value]
    bad = next((v for v in values if not 0 < v <= largest), None)
    if bad is not None:
        return [f"{key} is {bad:,}; it must be between 1 and {largest:,}"]
    return []


def _float_problems(key: str, entry: Entry) -> list[str]:
    if entry.type_id != F32:
        return [f"{key} is {entry.describe()}; llama.cpp reads an f32"]
    if not (math.isfinite(entry.value) and entry.value > 0):
        return [f"{key} is {entry.value}; it must be a positive, finite number"]
    return []


def _head_problems(header: Header, arch: str) -> list[str]:
    width = _int(header, f"{arch}.embedding_length")
    heads = layer_values(header, f"{arch}.attention.head_count") or []
    kv_heads = layer_values(header, f"{arch}.attention.head_count_kv") or heads
    for layer, (q, kv) in enumerate(zip(heads, kv_heads, strict=False)):
        if q % kv:
            return [f"{arch}.attention.head_count {q} is not a multiple of head_count_kv {kv} (layer {layer})"]
    if f"{arch}.attention.key_length" not in header.metadata and heads and width % heads[0]:
        return [
            f"{arch}.embedding_length {width} is not a multiple of attention.head_count {heads[0]}, "
            "and no attention.key_length says the head size"
        ]
    return []


def vocabulary_problems(header: Header) -> list[str]:
    tokens = header.metadata.get("tokenizer.ggml.tokens")
    if tokens is None:
        return []
    if tokens.type_id != ARRAY or tokens.item_type != STRING:
        return [f"tokenizer.ggml.tokens is {tokens.describe()}, not an array of strings"]
    vocab = len(tokens.value)
    if not vocab:
        return ["tokenizer.ggml.tokens is empty: a model needs a vocabulary"]
    problems = []
    for key, item, what in (
        ("tokenizer.ggml.scores", F32, "f32"),
        ("tokenizer.ggml.token_type", I32, "i32"),
        ("tokenizer.ggml.merges", STRING, "string"),
    ):
        entry = header.metadata.get(key)
        if entry is None:
            continue
        if entry.type_id != ARRAY or entry.item_type != item:
            problems.append(f"{key} is {entry.describe()}, not an array of {what}")
        elif item != STRING and len(entry.value) != vocab:
            problems.append(f"{key} has {len(entry.value):,} entries for a vocabulary of {vocab:,}")
    entry = header.metadata.get("tokenizer.ggml.model")
    if entry is not None and entry.type_id != STRING:
        problems.append(f"tokenizer.ggml.model is {entry.describe()}, not a string")
    for name in SPECIAL_IDS:
        key = f"tokenizer.ggml.{name}_token_id"
        entry = header.metadata.get(key)
        if entry is None:
            continue
        if entry.type_id not in INTEGERS:
            problems.append(f"{key} is {entry.describe()}; llama.cpp reads a u32")
        elif not 0 <= entry.value < vocab:
            problems.append(f"{key} {entry.value} is outside the vocabulary of {vocab:,} tokens")
    return problems


def optkit_manifest(header: Header) -> dict | None:
    """The `optkit.manifest` key (optkit's manifest as JSON), or None when absent; an OptkitError
    when it is there and not a JSON object (NaN and Infinity are not JSON)."""
    manifest = _manifest_or_problem(header)
    if isinstance(manifest, str):
        raise OptkitError(f"{header.path}: {manifest}")
    return manifest


def manifest_problems(header: Header) -> list[str]:
    manifest = _manifest_or_problem(header)
    return [manifest] if isinstance(manifest, str) else []


def _manifest_or_problem(header: Header) -> dict | str | None:
    entry = header.metadata.get("optkit.manifest")
    if entry is None:
        return None
    if not isinstance(entry.value, str):
        return f"optkit.manifest is {entry.describe()}, not optkit's manifest (a JSON string): re-create the file"
    try:
        manifest = json.loads(entry.value, parse_constant=_refuse_constant)
    except ValueError as e:
        return f"optkit.manifest is not valid JSON ({e}): re-create the file"
    except RecursionError:
        return "optkit.manifest nests too deep to be optkit's manifest: re-create the file"
    if not isinstance(manifest, dict):
        return f"optkit.manifest holds a JSON {type(manifest).__name__}, not an object: re-create the file"
    return manifest


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON")
