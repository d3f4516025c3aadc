"""`optkit verify model.gguf` without llama.cpp: the file's layout, the metadata llama.cpp needs for
its architecture, the tensors it builds, and every block decoding to finite numbers.

The checks, in order (a later one runs only when the earlier ones passed, since it reads what they
vouched for):
1. layout (formats/gguf_header.py): magic, version, a header that parses to its end, each tensor's
   bytes (its type's block size and bytes per block times its shape) inside the file, aligned and
   not overlapping another, no name twice;
2. metadata: the keys llama.cpp's loader reads without a default (llama-model.cpp load_hparams,
   llama-vocab.cpp load) for the architectures optkit writes (each family's, gguf_required.py: llama,
   qwen2, qwen3, gemma2, gemma3, phi3, olmo2, granite, qwen2moe, qwen3moe); for any other architecture
   the keys every one of them reads;
3. tensors: the ones those architectures' graphs require, token_embd as [embedding_length,
   vocabulary], each at the shape llama.cpp's loader creates it with;
4. values: every float tensor finite, every quantized block's scale (and minimum) finite, so its
   weights are (ggml's blocks hold integers times fp16 scales).
"""

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from optkit.errors import OptkitError
from optkit.quant.formats.gguf_header import Header, read_header, tensor_bytes
from optkit.quant.formats.gguf_hparams import architecture, metadata_value_problems
from optkit.quant.formats.gguf_required import arch_keys, block_shapes, written_as
from optkit.quant.formats.gguf_tensors import sizes, tensor_arrays, type_name

# keys llama.cpp reads with no default for any architecture ({arch} is general.architecture's value);
# those of the architectures optkit writes are their families' (gguf_required.py)
COMMON_KEYS = ("general.architecture", "{arch}.context_length", "{arch}.embedding_length", "{arch}.block_count")
VOCAB_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.tokens")
BPE_KEYS = ("tokenizer.ggml.merges",)  # tokenizer.ggml.model == "gpt2"
# tensors every graph requires (output.weight where the architecture ties no output: gguf_required.py)
GLOBAL_TENSORS = ("token_embd.weight", "output_norm.weight")
# ggml's blocks whose scales are fp16 halves: (bytes per block, offset of the halves, how many):
# the legacy blocks start with d (and m); the K-quants' super-blocks hold d (and dmin) first or
# last (ggml-common.h: block_q2_K .. block_q6_K)
MAX_NAME = 64  # GGML_MAX_NAME, the terminating NUL included
HALVES = {"Q4_0": (18, 0, 1), "Q4_1": (20, 0, 2), "Q8_0": (34, 0, 1), "Q5_0": (22, 0, 1), "Q5_1": (24, 0, 2)}
HALVES |= {"Q2_K": (84, 80, 2), "Q3_K": (110, 108, 1), "Q4_K": (144, 0, 2), "Q5_K": (176, 0, 2), "Q6_K": (210, 208, 1)}


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
    result = CheckResult(read_header(path))
    header = result.header
    result.problems += layout_problems(header)
    result.checked.append("layout")
    if result.problems:
        return result
    result.problems += metadata_problems(header)
    result.warnings += metadata_warnings(header)
    result.checked.append("metadata")
    if result.problems:
        return result
    result.problems += tensor_problems(header)
    result.checked.append("tensors")
    if result.problems:
        return result
    result.problems += value_problems(header)
    result.checked.append("values")
    return result


def open_checked(path: str | Path) -> Header:
    """The header of a file whose layout checks out, else OptkitError naming the first problem in one line."""
    header = read_header(path)
    problems = layout_problems(header)
    if problems:
        raise OptkitError(f"{path}: {problems[0]}")
    return header


def open_for_loading(path: str | Path) -> Header:
    """The header of a file whose layout, metadata and tensor shapes check out (what llama.cpp's
    loader checks; the tensor values are not read), else OptkitError naming the first problem."""
    header = open_checked(path)
    problems = metadata_problems(header) or tensor_problems(header)
    if problems:
        raise OptkitError(f"{path}: {problems[0]}")
    return header


def layout_problems(header: Header) -> list[str]:
    table = sizes()
    problems, spans, seen = [], [], set()
    for info in header.tensors:
        if info.name in seen:
            problems.append(f"tensor {info.name} appears twice")
        seen.add(info.name)
        if len(info.name.encode()) >= MAX_NAME:
            problems.append(f"tensor name {info.name[:MAX_NAME]}... is longer than ggml's {MAX_NAME - 1} bytes")
        size = tensor_bytes(info, table)
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


def required_keys(header: Header) -> list[str]:
    arch = architecture(header)
    written = written_as(header)
    keys = COMMON_KEYS + (arch_keys(written) if written is not None else ()) + VOCAB_KEYS
    if header.value("tokenizer.ggml.model") == "gpt2":
        keys += BPE_KEYS
    return [k.format(arch=arch) for k in keys]


def metadata_problems(header: Header) -> list[str]:
    if architecture(header) is not None:
        missing = [k for k in required_keys(header) if k not in header.metadata]
        if missing:
            arch = architecture(header)
            return [f"missing metadata {', '.join(missing)}: llama.cpp needs it to load a {arch} model"]
    elif "general.architecture" not in header.metadata:
        return ["missing metadata general.architecture: llama.cpp needs it to load any model"]
    return metadata_value_problems(header)


def metadata_warnings(header: Header) -> list[str]:
    warnings = []
    if header.value("tokenizer.ggml.model") == "gpt2" and "tokenizer.ggml.pre" not in header.metadata:
        warnings.append("no tokenizer.ggml.pre: llama.cpp splits text with its default regex, not the model's")
    if "tokenizer.chat_template" not in header.metadata:
        warnings.append("no tokenizer.chat_template: chat requests fall back to llama.cpp's default template")
    return warnings


def expected_shapes(header: Header) -> dict[str, list[int]]:
    """Tensor name -> the shape (GGUF order) llama.cpp's loader creates it with, for a header whose
    metadata checks out and an architecture optkit writes; {} for another."""
    arch = written_as(header)
    if arch is None:
        return {}
    width, vocab = header.value(f"{arch.name}.embedding_length"), len(header.value("tokenizer.ggml.tokens"))
    shapes = {"token_embd.weight": [width, vocab], "output_norm.weight": [width], "output.weight": [width, vocab]}
    for i, block in enumerate(block_shapes(header, arch)):
        shapes |= {f"blk.{i}.{name}.weight": shape for name, shape in block.items()}
        shapes |= {f"blk.{i}.attn_{n}.bias": [block[f"attn_{n}"][-1]] for n in ("q", "k", "v", "qkv")}
    return shapes


def tensor_problems(header: Header) -> list[str]:
    arch = architecture(header)
    names = {t.name: t for t in header.tensors}
    wanted = list(GLOBAL_TENSORS)
    written = written_as(header)
    if written is not None:
        blocks = header.value(f"{arch}.block_count")
        wanted += ["output.weight"] if written.output_required else []
        wanted += [f"blk.{i}.{n}.weight" for i in range(blocks) for n in written.required]
    missing = [n for n in wanted if n not in names]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        return [f"missing tensor {', '.join(missing[:3])}{more}: llama.cpp's {arch} graph needs it"]
    embd = names["token_embd.weight"]
    tokens = header.value("tokenizer.ggml.tokens")
    want = [header.value(f"{arch}.embedding_length"), len(tokens) if isinstance(tokens, list) else 0]
    if list(embd.dims) != want:
        shape = "×".join(str(d) for d in embd.dims)
        return [f"token_embd.weight is {shape}, not embedding_length × vocabulary ({want[0]}×{want[1]})"]
    problems = []
    for name, shape in expected_shapes(header).items():
        if name in names and list(names[name].dims) != shape:
            have = "×".join(str(d) for d in names[name].dims)
            problems.append(f"tensor {name} is {have}; the metadata makes it {'×'.join(map(str, shape))}")
    return problems[:3]


def value_problems(header: Header) -> list[str]:
    """Tensors holding NaN or ±inf. Float tensors are checked whole; legacy blocks and K-quant
    super-blocks by their fp16 scales (d, m, dmin); other block types (i-quants) through gguf-py's
    dequantizer."""
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    problems = []
    for info, data in tensor_arrays(header):
        kind = type_name(info.type_id)
        if info.type_id == T.BF16:
            values = (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif info.type_id in (T.F32, T.F16, T.F64):
            values = data
        elif kind in HALVES:
            block, start, halves = HALVES[kind]
            scales = data.reshape(-1, block)[:, start : start + 2 * halves]
            values = np.ascontiguousarray(scales).view(np.float16)
        elif info.type_id in (T.I8, T.I16, T.I32, T.I64):
            continue
        else:
            try:
                values = quants.dequantize(np.asarray(data), T(info.type_id))
            except NotImplementedError:
                continue
        bad = int(np.count_nonzero(~np.isfinite(values)))
        if bad:
            what = "scales" if kind in HALVES else "values"
            problems.append(f"tensor {info.name} ({kind}): {bad} {what} are NaN or infinite")
    return problems
