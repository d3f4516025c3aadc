"""Is this model one optkit supports? Read from config.json alone (json, no torch, no transformers),
so that every command refuses an unsupported `model_type` in one line before it loads anything."""

import json
from pathlib import Path

from optkit.errors import OptkitError
from optkit.families import family_for, model_types

# where modeldir.resolve_model_dir finds the reference models by name (modeldir imports torch)
_BUNDLED_DIR = Path(__file__).resolve().parents[1] / "zoo" / "models"


def model_config_json(name_or_path: str | Path) -> tuple[Path, dict] | None:
    """(config.json's path, its content) of a model directory or reference model name; None when
    there is none or it is not JSON (the command's own checks say what is wrong then)."""
    path = Path(name_or_path)
    if not path.exists() and path.name == str(name_or_path):
        path = _BUNDLED_DIR / str(name_or_path)
    file = path / "config.json"
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError, RecursionError):
        return None
    return (file, config) if isinstance(config, dict) else None


def describe_families(runtime: bool = False) -> str:
    """'llama (llama, mistral, qwen2, qwen3), granite, olmo2, phi3': each family with its model_types."""
    families = {family_for(t).name: family_for(t) for t in model_types(runtime=runtime)}  # registration order
    names = []
    for family in families.values():
        types = family.model_types
        names.append(family.name if types == (family.name,) else f"{family.name} ({', '.join(types)})")
    return ", ".join(names)


def require_supported(name_or_path: str | Path, runtime: bool = False) -> None:
    """One OptkitError line naming the supported families when the model's model_type is not one of
    them (`runtime`: one the optkit runtime runs). A model without a readable config.json passes:
    the command's checks of the directory name that problem."""
    found = model_config_json(name_or_path)
    if found is None:
        return
    file, config = found
    model_type = config.get("model_type")
    if model_type in model_types(runtime=runtime):
        return
    what = "the optkit runtime runs" if runtime else "optkit supports"
    raise OptkitError(
        f"{file}: model_type {model_type!r} is not supported: {what} {describe_families(runtime)} (docs/models.md)"
    )
