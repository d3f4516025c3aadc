"""Checkpoint formats: each module writes (`compress`, `quantization_config`, `check`) and reads
(`dequantized_state_dict`) one on-disk layout. The format is named in config.json, never in a file name.

Modules are imported on first use: the compressed-tensors module needs the `compressed_tensors`
package, which a machine that only reads GPTQ or AWQ checkpoints need not have.
"""

import importlib
from types import ModuleType

from optkit.errors import OptkitError

# --format NAME -> module
FORMATS: dict[str, str] = {
    "compressed-tensors": "optkit.quant.formats.compressed_tensors",
    "gptq": "optkit.quant.formats.gptq",
    "awq": "optkit.quant.formats.awq",
}
# config.json `quantization_config.quant_method` -> the module that reads it
READERS: dict[str, str] = {
    "compressed-tensors": FORMATS["compressed-tensors"],
    "gptq": FORMATS["gptq"],
    "awq": FORMATS["awq"],
}


def get_format(name: str) -> ModuleType:
    if name not in FORMATS:
        raise OptkitError(f"unknown --format {name!r}: choose one of {', '.join(FORMATS)}")
    return importlib.import_module(FORMATS[name])


def reader_for(quant_config: dict, where: str) -> ModuleType:
    method = quant_config.get("quant_method")
    if method not in READERS:
        raise OptkitError(
            f"{where}: quantization method {method!r} is not supported: optkit reads {', '.join(READERS)}"
        )
    return importlib.import_module(READERS[method])
