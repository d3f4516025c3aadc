"""CheckpointFormat's defaults as plain functions, for a format written as a module to bind by name
(`from optkit.quant.formats.defaults import constrain`): a module cannot inherit the Protocol's
bodies. Each answers as the Protocol's docstring of the same member says."""

from collections.abc import Callable
from pathlib import Path


def quant_method_is(name: str) -> Callable[[dict], bool]:
    """`detect` for a format whose blocks name it in `quant_method` (every built-in does)."""
    return lambda quant_config: quant_config.get("quant_method") == name


def check_model(config: dict, model_dir: Path) -> None:
    """Nothing of the model beyond `check`'s layers that the layout cannot hold."""


def constrain(scheme):
    return scheme


def gptq_defaults(scheme) -> dict:
    return {}


def is_w8a8(quant_config: dict) -> bool:
    return False


def w8a8_modules(tensors: dict, quant_config: dict) -> dict:
    return {}


def write_file(staged: Path, out: Path, manifest: dict) -> None:
    raise NotImplementedError("a directory format writes no file")


def file_config(path: Path) -> dict:
    raise NotImplementedError("a directory format has no file to read a config from")


def vllm_loader(kind) -> None:
    """vLLM has no loader for it."""
