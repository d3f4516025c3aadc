"""Checkpoint formats: each module writes (`compress`, `quantization_config`, `check`) and reads
(`dequantized_state_dict`) one on-disk layout. The format is named in config.json, never in a file name."""

from types import ModuleType

from optkit.errors import OptkitError
from optkit.quant.formats import awq, compressed_tensors, gptq

FORMATS: dict[str, ModuleType] = {compressed_tensors.NAME: compressed_tensors, gptq.NAME: gptq, awq.NAME: awq}
# config.json `quantization_config.quant_method` -> the module that reads it
READERS: dict[str, ModuleType] = {"compressed-tensors": compressed_tensors, "gptq": gptq, "awq": awq}


def get_format(name: str) -> ModuleType:
    if name not in FORMATS:
        raise OptkitError(f"unknown --format {name!r}: choose one of {', '.join(FORMATS)}")
    return FORMATS[name]


def reader_for(quant_config: dict, where: str) -> ModuleType:
    method = quant_config.get("quant_method")
    if method not in READERS:
        raise OptkitError(
            f"{where}: quantization method {method!r} is not supported: optkit reads {', '.join(READERS)}"
        )
    return READERS[method]
