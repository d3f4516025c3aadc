"""Reading the YAML files users give (recipes, tiers): a mapping, or a one-line error saying why not."""

from pathlib import Path

import yaml

from optkit.errors import OptkitError


def read_yaml_mapping(path: str | Path, what: str, *, missing_hint: str = "", keys_hint: str = "") -> dict:
    """The file's top-level mapping. `what` names the file in errors ("recipe", "--tiers");
    `missing_hint` and `keys_hint` end the messages for a missing file and for a file that is
    not a mapping."""
    file = Path(path)
    if not file.is_file():
        raise OptkitError(f"{what} {path} does not exist: give a YAML file{missing_hint}")
    try:
        data = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as e:
        raise OptkitError(f"{what} {file} is not valid YAML: {str(e).splitlines()[0]}") from e
    if not isinstance(data, dict):
        raise OptkitError(f"{what} {file} must be a mapping of keys{keys_hint}")
    return data
