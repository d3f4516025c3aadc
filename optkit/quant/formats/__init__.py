"""Checkpoint formats, found by name: each writes and reads one on-disk layout, named in
config.json's `quantization_config` (never in a file name).

A format is any object with the members of `CheckpointFormat` (a module works: compressed_tensors.py,
gptq.py, awq.py are registered as modules). Built-in modules are imported on first use: the
compressed-tensors module needs the `compressed_tensors` package, which a machine that only reads
GPTQ or AWQ checkpoints need not have. Adding a format: one module, one `register_format` line
below (or, from outside optkit, a call to `register_format` with the object itself).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from optkit.errors import OptkitError

if TYPE_CHECKING:
    import torch

    from optkit.weights.quantized import QuantizedWeight
    from optkit.weights.schemes import WeightScheme


@runtime_checkable
class CheckpointFormat(Protocol):
    """What the quantizer (write side) and the loaders (read side) need of a format.

    NAME is `--format`'s value; MARKER is the tensor suffix that marks a quantized linear
    (`P.qweight`), SUFFIXES every tensor suffix a quantized linear owns.

    Optional members, looked up with getattr (absent means "no"):
    - `is_w8a8(quant_config) -> bool` and `w8a8_modules(tensors, quant_config)`: the format also
      stores int8 weights with int8 activations (compressed-tensors).
    - Room for formats that constrain the grid: a format whose layout restricts the scales or zero
      points (GGUF keeps fp16 block scales) is to expose `constrain(scheme) -> grid` which a
      method's procedure then quantizes onto (e.g. GPTQ with the scales it will be stored with),
      so that what is written is exactly what was optimized; `check` refuses schemes it cannot hold.
    - Room for formats evaluated by an outside runtime: `runtime` naming it (e.g. "llama.cpp"),
      for formats the optkit runtime does not load (their `decompress` may then raise); the gate
      is to hand such an artifact to that runtime instead of `models/loader.py`.
    """

    NAME: str
    MARKER: str
    SUFFIXES: tuple[str, ...]

    def detect(self, quant_config: dict) -> bool:
        """Whether a config.json `quantization_config` block was written by this format."""

    def check(
        self, scheme: WeightScheme, act_order: bool | str, layers: list[tuple[str, int, int]], activations: str | None
    ) -> None:
        """An OptkitError for what this layout cannot store; layers: (name, in_features, out_features)."""

    def quantization_config(
        self, scheme: WeightScheme, act_order: bool | str, ignore: list[str], activations: str | None
    ) -> dict:
        """The `quantization_config` block of config.json."""

    def compress(self, prefix: str, qw: QuantizedWeight, activations: str | None) -> dict[str, torch.Tensor]:
        """The tensors of one quantized linear, keyed `prefix.SUFFIX`."""

    def decompress(self, prefix: str, tensors: dict[str, torch.Tensor], scheme: WeightScheme) -> QuantizedWeight: ...

    def scheme_from_config(self, quant_config: dict) -> WeightScheme: ...

    def dequantized_state_dict(
        self, tensors: dict[str, torch.Tensor], quant_config: dict, dtype: torch.dtype
    ) -> dict[str, torch.Tensor]:
        """A plain state dict: every quantized linear replaced by its dequantized `weight`."""


# --format NAME -> the format, or the module that holds it (imported on first use)
_REGISTRY: dict[str, CheckpointFormat | str] = {}


def register_format(name: str, fmt: CheckpointFormat | str) -> None:
    if name in _REGISTRY:
        raise ValueError(f"format {name!r} is already registered")
    _REGISTRY[name] = fmt


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
    return importlib.import_module(fmt) if isinstance(fmt, str) else fmt


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


register_format("compressed-tensors", "optkit.quant.formats.compressed_tensors")
register_format("gptq", "optkit.quant.formats.gptq")
register_format("awq", "optkit.quant.formats.awq")
register_format("gguf", "optkit.quant.formats.gguf")
register_format("bitsandbytes", "optkit.quant.formats.bitsandbytes")
