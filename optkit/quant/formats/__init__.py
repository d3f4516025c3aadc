"""Checkpoint formats, found by name: each writes and reads one on-disk layout, named in
config.json's `quantization_config` (never in a file name).

A format is any object with every member of `CheckpointFormat`. A class that subclasses it takes
the Protocol's defaults for the members it leaves out (the toy plug-in of tests/quant/
test_plugin_format.py); the built-ins are modules (compressed_tensors.py, gptq.py, awq.py,
bitsandbytes.py, gguf.py) that declare every member, binding the defaults they keep from
formats/defaults.py. Built-in modules are imported on first use: the compressed-tensors module
needs the `compressed_tensors` package, which a machine that only reads GPTQ or AWQ checkpoints
need not have. Adding a format: one module and one `register_format` line below, or, from outside
optkit, a call to `register_format` with the object itself.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from optkit.errors import OptkitError
from optkit.quant.formats.kind import ArtifactKind

if TYPE_CHECKING:
    import torch

    from optkit.weights.quantized import QuantizedWeight
    from optkit.weights.schemes import WeightScheme


@runtime_checkable
class CheckpointFormat(Protocol):
    """What the quantizer (write side), the loaders (read side), the gate and the compatibility
    matrix need of a format. Members with a body here are the defaults (said in their docstrings).

    NAME is `--format`'s value; MARKER is the tensor suffix that marks a quantized linear
    (`P.qweight`), SUFFIXES every tensor suffix a quantized linear owns.
    SUFFIX: None for a format whose artifact is a directory; a single-file format (GGUF) names its
    file's suffix (".gguf"): the quantizer stages an artifact directory, then `write_file` turns
    it into the file, and the gate and `optkit run` recognise a file artifact by it.
    runtime: None when optkit's runtime and `quant/formats/load.py` run it; else the outside
    runtime that does (GGUF: "llama.cpp"), which the gate hands a file artifact to.
    LOADERS: the loaders besides vLLM that read it, as the compatibility matrix names them
    ("optkit", "transformers", "gptqmodel", "llama.cpp"), each with the packages it needs beyond
    itself (transformers reads bitsandbytes' NF4 only with `bitsandbytes` installed); vLLM reads it
    when `vllm_loader` names one of vLLM's loaders.
    """

    NAME: str
    MARKER: str
    SUFFIXES: tuple[str, ...]
    SUFFIX: str | None = None
    runtime: str | None = None
    LOADERS: Mapping[str, tuple[str, ...]] = MappingProxyType({"optkit": ()})

    def detect(self, quant_config: dict) -> bool:
        """Whether a config.json `quantization_config` block was written by this format
        (default: its `quant_method` is NAME)."""
        return quant_config.get("quant_method") == self.NAME

    def check(
        self, scheme: WeightScheme, act_order: bool | str, layers: list[tuple[str, int, int]], activations: str | None
    ) -> None:
        """An OptkitError for what this layout cannot store; layers: (name, in_features, out_features)."""

    def check_model(self, config: dict, model_dir: Path) -> None:
        """Before any calibration, an OptkitError for what of the model (config.json, its tokenizer)
        the layout cannot hold (default: nothing beyond `check`; GGUF: architecture, RoPE, tokenizer)."""

    def constrain(self, scheme: WeightScheme) -> WeightScheme:
        """The scheme the methods quantize onto, for a layout that fixes the stored scales or zero
        points (GGUF's fp16 blocks: a StoredScheme), so that what is written is exactly what was
        optimized; `check` refuses schemes it cannot hold (default: the scheme itself)."""
        return scheme

    def gptq_defaults(self, scheme: WeightScheme) -> dict:
        """GPTQ's settings for `scheme` when the recipe leaves them unset (default: none, GPTQ's own)."""
        return {}

    def quantization_config(
        self, scheme: WeightScheme, act_order: bool | str, ignore: list[str], activations: str | None
    ) -> dict:
        """The `quantization_config` block of config.json."""

    def compress(self, prefix: str, qw: QuantizedWeight, activations: str | None) -> dict[str, torch.Tensor]:
        """The tensors of one quantized linear, keyed `prefix.SUFFIX`."""

    def write_file(self, staged: Path, out: Path, manifest: dict) -> None:
        """A single-file format (SUFFIX): the file `out` for the staged artifact directory, written
        to a new temporary name and renamed into place. Never asked of a directory format."""
        raise NotImplementedError(f"--format {self.NAME} writes an artifact directory, not a file")

    def file_config(self, path: Path) -> dict:
        """A single-file format (SUFFIX): the Hugging Face config.json its file describes, for the
        gate. Never asked of a directory format."""
        raise NotImplementedError(f"--format {self.NAME} writes an artifact directory, not a file")

    def decompress(self, prefix: str, tensors: dict[str, torch.Tensor], scheme: WeightScheme) -> QuantizedWeight: ...

    def scheme_from_config(self, quant_config: dict) -> WeightScheme: ...

    def dequantized_state_dict(
        self, tensors: dict[str, torch.Tensor], quant_config: dict, dtype: torch.dtype
    ) -> dict[str, torch.Tensor]:
        """A plain state dict: every quantized linear replaced by its dequantized `weight`."""

    def is_w8a8(self, quant_config: dict) -> bool:
        """Whether the block stores 8-bit weights with 8-bit activations, read by `w8a8_modules`
        instead of `decompress` (default: no; compressed-tensors' int- and float-quantized)."""
        return False

    def w8a8_modules(self, tensors: dict[str, torch.Tensor], quant_config: dict) -> dict[str, torch.nn.Module]:
        """module path -> the runtime's int8 (or FP8) linear, for a block `is_w8a8` says yes to (default: none)."""
        return {}

    def artifact_kind(self, quant_config: dict) -> ArtifactKind:
        """What the compatibility matrix and the vLLM spec check need to know of an artifact
        (default: its scheme's bits, symmetry and number type, and `is_w8a8`)."""
        scheme = self.scheme_from_config(quant_config)
        return ArtifactKind(self.NAME, scheme.bits, scheme.symmetric, self.is_w8a8(quant_config), scheme.type)

    def vllm_loader(self, kind: ArtifactKind) -> str | None:
        """The vLLM loader that reads an artifact of `kind` (compat/vllm_spec.py has its layout), or
        None where vLLM has none (default)."""
        return None


MEMBERS = tuple(
    sorted(
        set(CheckpointFormat.__annotations__)
        | {name for name, value in vars(CheckpointFormat).items() if callable(value) and not name.startswith("_")}
    )
)


# --format NAME -> the format, or the module that holds it (imported on first use)
_REGISTRY: dict[str, CheckpointFormat | str] = {}


def register_format(name: str, fmt: CheckpointFormat | str) -> None:
    if name in _REGISTRY:
        raise ValueError(f"format {name!r} is already registered")
    if not isinstance(fmt, str):
        _check_members(name, fmt)
    _REGISTRY[name] = fmt


def _check_members(name: str, fmt: object) -> None:
    missing = [member for member in MEMBERS if not hasattr(fmt, member)]
    if missing:
        raise ValueError(
            f"format {name!r} lacks {', '.join(missing)} of CheckpointFormat: declare them, "
            "or subclass CheckpointFormat for its defaults"
        )


def unregister_format(name: str) -> None:
    _REGISTRY.pop(name, None)


@contextmanager
def registered_format(name: str, fmt: CheckpointFormat) -> Iterator[CheckpointFormat]:
    """`register_format` for the duration of a block (tests)."""
    register_format(name, fmt)
    try:
        yield fmt
    finally:
        unregister_format(name)


def format_names() -> list[str]:
    return list(_REGISTRY)


def get_format(name: str) -> CheckpointFormat:
    if name not in _REGISTRY:
        raise OptkitError(f"unknown --format {name!r}: choose one of {', '.join(_REGISTRY)}")
    fmt = _REGISTRY[name]
    if isinstance(fmt, str):
        module = importlib.import_module(fmt)
        _check_members(name, module)
        _REGISTRY[name] = fmt = module
    return fmt


def reader_for(quant_config: dict, where: str) -> CheckpointFormat:
    """The format that wrote a `quantization_config` block. The block's `quant_method` names the
    format (each built-in's `detect` compares it), so only that format's module is imported."""
    method = quant_config.get("quant_method")
    candidates = [method] if method in _REGISTRY else []
    candidates += [name for name, fmt in _REGISTRY.items() if name != method and not isinstance(fmt, str)]
    for name in candidates:
        fmt = get_format(name)
        if fmt.detect(quant_config):
            return fmt
    raise OptkitError(f"{where}: quantization method {method!r} is not supported: optkit reads {', '.join(_REGISTRY)}")


def file_format(path: str | Path) -> CheckpointFormat | None:
    """The single-file format whose file `path` is (by its SUFFIX: a .gguf is GGUF's), or None for
    a directory or a model name."""
    path = Path(path)
    if not path.is_file():
        return None
    return next((fmt for fmt in map(get_format, _REGISTRY) if fmt.SUFFIX == path.suffix), None)


register_format("compressed-tensors", "optkit.quant.formats.compressed_tensors")
register_format("gptq", "optkit.quant.formats.gptq")
register_format("awq", "optkit.quant.formats.awq")
register_format("gguf", "optkit.quant.formats.gguf")
register_format("bitsandbytes", "optkit.quant.formats.bitsandbytes")
