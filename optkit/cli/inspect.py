"""`optkit inspect`: what an artifact is and how much each layer lost."""

import json
from pathlib import Path
from typing import Annotated

import typer

from optkit.cli.options import JsonFlag, console, print_json, print_table, require_supported
from optkit.text_safety import rich_text

MAX_SHOWN_CHARS = 20_000  # a method's options, or the versions, as JSON: a few hundred characters


def inspect(
    artifact: Annotated[str, typer.Argument(help="Artifact directory written by optkit, or a .gguf file.")],
    json_output: JsonFlag = False,
) -> None:
    """Show an artifact's manifest and per-layer quantization error; for a .gguf (any, not only
    optkit's): its architecture, hyperparameters, tokenizer, chat template, tensors by type and shape.

    Example: optkit inspect out/small-w4 --json ; optkit inspect model.gguf
    """
    from optkit.cli.gguf_file import inspect_gguf, is_file_argument

    if is_file_argument(artifact):
        inspect_gguf(Path(artifact), json_output)
        return
    require_supported(artifact)
    from rich.table import Table

    from optkit.errors import OptkitError
    from optkit.manifest import read_manifest
    from optkit.modeldir import resolve_model_dir
    from optkit.quant.head import head_summary

    path = resolve_model_dir(artifact)
    manifest = read_manifest(path)
    if manifest is None:
        raise OptkitError(f"{path} has no optkit.json: inspect reads artifacts written by `optkit quantize`")
    if json_output:
        print_json(manifest)
        return
    shown_fields(manifest, path)
    out = console()
    summary = Table(title=rich_text(f"artifact {path}"), show_header=False)
    summary.add_column()
    summary.add_column(overflow="fold")
    for key, value in [
        ("method", manifest["method"]),
        ("options", manifest["options"]),
        ("format", manifest["format"]),
        ("base model", f"{manifest['base_model']['path']} (sha256 {manifest['base_model']['sha256'][:12]})"),
        ("calibration", manifest["calibration"].get("name") or "none"),
        ("ignored layers", ", ".join(manifest["ignored_layers"]) or "none"),
        ("output head", head_summary(manifest.get("head"))),
        ("files", ", ".join(manifest["files"])),
        ("versions", ", ".join(f"{k} {v}" for k, v in manifest["versions"].items())),
        ("created", f"{manifest['created']} in {manifest['wall_time_s']:.1f}s"),
    ]:
        summary.add_row(key, rich_text(value))  # the manifest's values are the file's: text, not markup
    out.print(summary)
    print_table(where_it_loads_table(path), out)
    layers = Table(title="per-layer weight error")
    for column in ("layer", "shape", "rel. error", "MSE"):
        layers.add_column(column, justify="left" if column == "layer" else "right")
    for layer in manifest["layers"]:
        layers.add_row(
            rich_text(layer["name"]),
            "×".join(map(str, layer["shape"])),
            f"{layer['rel_error']:.4f}",
            f"{layer['mse']:.3e}",
        )
    print_table(layers, out)


def shown_fields(manifest: dict, path: Path) -> None:
    """The fields the tables show are of the types optkit writes, and short enough to print; else
    one OptkitError naming the first that is not (optkit.json comes with the artifact)."""
    from optkit.errors import OptkitError
    from optkit.manifest import MANIFEST

    def refuse(field: str, what: str):
        raise OptkitError(f"{path / MANIFEST}: {field} is not {what}: re-create or re-download the artifact")

    def number(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    for key, kind, what in (
        ("method", str, "a string"),
        ("format", str, "a string"),
        ("options", dict, "a mapping"),
        ("base_model", dict, "a mapping"),
        ("calibration", dict, "a mapping"),
        ("ignored_layers", list, "a list"),
        ("versions", dict, "a mapping"),
        ("created", str, "a string"),
        ("layers", list, "a list"),
    ):
        if not isinstance(manifest.get(key), kind):
            refuse(key, what)
    if not number(manifest.get("wall_time_s")):
        refuse("wall_time_s", "a number")
    if not all(isinstance(manifest["base_model"].get(key), str) for key in ("path", "sha256")):
        refuse("base_model", "a path and a sha256")
    if not isinstance(manifest["calibration"].get("name"), (str, type(None))):
        refuse("calibration.name", "a string or null")
    if not all(isinstance(name, str) for name in manifest["ignored_layers"]):
        refuse("ignored_layers", "a list of layer names")
    head = manifest.get("head")
    if head is not None and not (
        isinstance(head, dict)
        and all(isinstance(head.get(key), str) for key in ("setting", "method"))
        and len(head["setting"] + head["method"]) < 64
        and isinstance(head.get("untied"), bool)
        and isinstance(head.get("added_bytes"), int)
        and not isinstance(head["added_bytes"], bool)
    ):
        refuse("head", "a head record (setting, method, untied, added_bytes)")
    for key in ("options", "versions"):
        if len(json.dumps(manifest[key], default=str)) > MAX_SHOWN_CHARS:
            refuse(key, f"what optkit writes there (at most {MAX_SHOWN_CHARS:,} characters)")
    for i, layer in enumerate(manifest["layers"]):
        if not (
            isinstance(layer, dict)
            and isinstance(layer.get("name"), str)
            and isinstance(layer.get("shape"), list)
            and all(isinstance(d, int) and not isinstance(d, bool) for d in layer["shape"])
            and number(layer.get("rel_error"))
            and number(layer.get("mse"))
        ):
            refuse(f"layers[{i}]", "a layer's name, shape (whole numbers), rel_error and mse")


def where_it_loads_table(path):
    """Where this artifact is known to load, from the compatibility matrix (optkit/compat/matrix.py)."""
    from rich.table import Table

    from optkit.compat.matrix import kind_from_quant_config, where_it_loads
    from optkit.errors import OptkitError
    from optkit.modeldir import read_config

    config = read_config(path)
    if not isinstance(config.get("quantization_config"), dict):
        raise OptkitError(
            f"{path / 'config.json'} has no quantization_config, yet optkit.json is a quantized artifact's "
            "manifest: re-create or re-download the artifact"
        )
    kind = kind_from_quant_config(config["quantization_config"], str(path / "config.json"))  # as its format says
    table = Table(title=f"where it loads ({kind.describe()}; docs/compatibility.md)", show_header=False)
    for loader, status in where_it_loads(kind, model_type=config.get("model_type")):
        table.add_row(loader, status)
    return table
