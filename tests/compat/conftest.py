"""Artifacts for the compatibility matrix, and the recorder that bench/compat_matrix.py reads.

Set OPTKIT_COMPAT_RESULTS=FILE to have every cell's outcome appended to FILE (JSON lines)."""

import json
import os
from pathlib import Path

import pytest

from tests.tiny_families import save_tiny_family


@pytest.fixture(scope="session")
def family_dir(tmp_path_factory, draft_dir):
    """family name -> a tiny random model of that family (norms and biases perturbed so they count)."""
    made: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in made:
            made[name] = save_tiny_family(name, tmp_path_factory.mktemp("families") / name, draft_dir)
        return made[name]

    return make


@pytest.fixture(scope="session")
def record():
    """record(cell: dict) appends one outcome to $OPTKIT_COMPAT_RESULTS, when set."""
    target = os.environ.get("OPTKIT_COMPAT_RESULTS")

    def write(cell: dict) -> None:
        if target:
            with open(target, "a") as f:
                f.write(json.dumps(cell, sort_keys=True) + "\n")

    return write
