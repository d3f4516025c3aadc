"""`optkit verify model.gguf` without llama.cpp: the file's layout, the metadata llama.cpp needs for
its architecture, the tensors it builds, and every block decoding to finite numbers.

The checks, in order (a later one runs only when the earlier ones passed, since it reads what they
vouched for):
1. layout (formats/gguf_header.py): magic, version, a header that parses to its end, each tensor's
   bytes (its type's block size and bytes per block times its shape) inside the file, aligned and
   not overlapping another, no name twice;
2. metadata: the keys llama.cpp's loader reads without a default (llama-model.cpp load_hparams,
   llama-vocab.cpp load) for the architectures optkit writes (llama, qwen2, qwen3); for any other
   architecture the keys every one of them reads;
3. tensors: the ones llama.cpp's llama/qwen2/qwen3 graphs require, token_embd as [embedding_length,
   vocabulary] (the sizes llama.cpp checks each tensor against);
4. values: every float tensor finite, every quantized block's scale (and minimum) finite, so its
   weights are (ggml's blocks hold integers times fp16 scales).
"""

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from optkit.errors import OptkitError
from optkit.quant.formats.gguf_header import Header, read_header, tensor_bytes

# keys llama.cpp reads with no default, per architecture ({arch} is general.architecture's value)
COMMON_KEYS = ("general.architecture", "{arch}.context_length", "{arch}.embedding_length", "{arch}.block_count")
ARCH_KEYS = {
    arch: (
        *COMMON_KEYS,
        "{arch}.feed_forward_length",
        "{arch}.attention.head_count",
        "{arch}.attention.layer_norm_rms_epsilon",
    )
    for arch in ("llama", "qwen2", "qwen3")
}
VOCAB_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.tokens")
BPE_KEYS = ("tokenizer.ggml.merges",)  # tokenizer.ggml.model == "gpt2"
# tensors llama.cpp's graph for the architecture requires (output.weight is optional: tied embeddings)
GLOBAL_TENSORS = ("token_embd.weight", "output_norm.weight")
BLOCK_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
ARCH_BLOCK_TENSORS = {
    "llama": BLOCK_TENSORS,
    "qwen2": BLOCK_TENSORS,
    "qwen3": (*BLOCK_TENSORS, "attn_q_norm", "attn_k_norm"),
}
# ggml's legacy blocks: (bytes per block, the fp16 halves at its start: d, or d and m)
HALVES = {"Q4_0": (18, 1), "Q4_1": (20, 2), "Q8_0": (34, 1), "Q5_0": (22, 1), "Q5_1": (24, 2)}


@dataclass
class CheckResult:
    header: Header
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    checked: list[str] = field(default_factory=list)  # names of the checks that ran

    @property
    def ok(self) -> bool:
        return not self.problems


def check_file(path: str | Path) -> CheckResult:
    """Every check above; raises OptkitError (one line) when the header itself does not parse."""
    path = Path(path)
    result = CheckResult(read_header(path))
    result.problems += layout_problems(result.header)
    result.checked.append("layout")
    if result.problems:
        return result
    import gguf

    reader = gguf.GGUFReader(path)
    result.problems += metadata_problems(reader)
    result.warnings += metadata_warnings(reader)
    result.checked.append("metadata")
    if result.problems:
        return result
    result.problems += tensor_problems(reader)
    result.checked.append("tensors")
    result.problems += value_problems(reader)
    result.checked.append("values")
    return result


def open_checked(path: str | Path):
    """(header, gguf-py's reader) for a file whose layout checks out, else OptkitError naming the
    first problem in one line (gguf-py's own errors do not say "truncated")."""
    import gguf

    header = read_header(path)
    problems = layout_problems(header)
    if problems:
        raise OptkitError(f"{path}: {problems[0]}")
    return header, gguf.GGUFReader(path)


def layout_problems(header: Header) -> list[str]:
    import gguf

    sizes = {int(t): v for t, v in gguf.GGML_QUANT_SIZES.items()}
    problems, spans, seen = [], [], set()
    for info in header.tensors:
        if info.name in seen:
            problems.append(f"tensor {info.name} appears twice")
        seen.add(info.name)
        size = tensor_bytes(info, sizes)
        if isinstance(size, str):
            problems.append(f"tensor {info.name}: {size}")
            continue
        if info.offset % header.alignment:
            problems.append(f"tensor {info.name}: offset {info.offset} is not aligned to {header.alignment} bytes")
        start = header.data_start + info.offset
        if start + size > header.file_size:
            return problems + [
                f"truncated: tensor {info.name} needs bytes up to {start + size:,} and the file has "
                f"{header.file_size:,}: the file is incomplete, copy or download it again"
            ]
        spans.append((start, start + size, info.name))
    spans.sort()
    for (_, end, name), (start, _, following) in zip(spans, spans[1:], strict=False):
        if start < end:
            problems.append(f"tensors {name} and {following} overlap: the header is corrupted")
    return problems


def _value(reader, key: str, default=None):
    entry = reader.fields.get(key)
    return default if entry is None else entry.contents()


def required_keys(reader) -> list[str]:
    arch = _value(reader, "general.architecture")
    keys = ARCH_KEYS.get(arch, COMMON_KEYS) + VOCAB_KEYS
    if _value(reader, "tokenizer.ggml.model") == "gpt2":
        keys += BPE_KEYS
    return [k.format(arch=arch) for k in keys]


def metadata_problems(reader) -> list[str]:
    missing = [k for k in required_keys(reader) if k not in reader.fields]
    if missing:
        arch = _value(reader, "general.architecture") or "unknown"
        return [f"missing metadata {', '.join(missing)}: llama.cpp needs it to load a {arch} model"]
    return []


def metadata_warnings(reader) -> list[str]:
    warnings = []
    if _value(reader, "tokenizer.ggml.model") == "gpt2" and "tokenizer.ggml.pre" not in reader.fields:
        warnings.append("no tokenizer.ggml.pre: llama.cpp splits text with its default regex, not the model's")
    if "tokenizer.chat_template" not in reader.fields:
        warnings.append("no tokenizer.chat_template: chat requests fall back to llama.cpp's default template")
    return warnings


def tensor_problems(reader) -> list[str]:
    arch = _value(reader, "general.architecture")
    names = {t.name: t for t in reader.tensors}
    wanted = list(GLOBAL_TENSORS)
    if arch in ARCH_BLOCK_TENSORS:
        blocks = _value(reader, f"{arch}.block_count")
        wanted += [f"blk.{i}.{n}.weight" for i in range(blocks) for n in ARCH_BLOCK_TENSORS[arch]]
    missing = [n for n in wanted if n not in names]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        return [f"missing tensor {', '.join(missing[:3])}{more}: llama.cpp's {arch} graph needs it"]
    embd = names["token_embd.weight"]
    want = [_value(reader, f"{arch}.embedding_length"), len(reader.fields["tokenizer.ggml.tokens"].data)]
    if [int(d) for d in embd.shape] != want:
        shape = "×".join(str(int(d)) for d in embd.shape)
        return [f"token_embd.weight is {shape}, not embedding_length × vocabulary ({want[0]}×{want[1]})"]
    return []


def value_problems(reader) -> list[str]:
    """Tensors holding NaN or ±inf. Float tensors are checked whole; legacy quantized blocks by their
    fp16 scales; other block types (K-quants, i-quants) through gguf-py's dequantizer."""
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    problems = []
    for tensor in reader.tensors:
        kind = tensor.tensor_type
        data = np.asarray(tensor.data)
        if kind == T.BF16:
            values = (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif kind in (T.F32, T.F16, T.F64):
            values = data
        elif kind.name in HALVES:
            block, halves = HALVES[kind.name]
            scales = data.reshape(-1, block)[:, : 2 * halves]
            values = np.ascontiguousarray(scales).view(np.float16)
        elif kind in (T.I8, T.I16, T.I32, T.I64):
            continue
        else:
            try:
                values = quants.dequantize(data, kind)
            except NotImplementedError:
                continue
        bad = int(np.count_nonzero(~np.isfinite(values)))
        if bad:
            what = "scales" if kind.name in HALVES else "values"
            problems.append(f"tensor {tensor.name} ({kind.name}): {bad} {what} are NaN or infinite")
    return problems
