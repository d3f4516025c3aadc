import sys
from pathlib import Path

import pytest
import torch

torch.manual_seed(0)


@pytest.fixture(scope="session")
def draft_dir() -> Path:
    from optkit.modeldir import resolve_model_dir

    return resolve_model_dir("draft")


@pytest.fixture(scope="session")
def small_dir() -> Path:
    from optkit.modeldir import resolve_model_dir

    return resolve_model_dir("small")


@pytest.fixture(scope="session")
def small_moe_dir() -> Path:
    from optkit.modeldir import resolve_model_dir

    return resolve_model_dir("small-moe")


@pytest.fixture(scope="session")
def small_outliers_dir(tmp_path_factory, small_dir) -> Path:
    """`small` with activation outliers and the same function (optkit/zoo/outliers.py)."""
    from optkit.zoo.outliers import add_activation_outliers

    return add_activation_outliers(small_dir, tmp_path_factory.mktemp("small") / "outliers")


@pytest.fixture(scope="session")
def draft_w2(tmp_path_factory, draft_dir) -> Path:
    """A badly degraded artifact (RTN 2-bit per channel of `draft`), for gates that must fail."""
    from optkit.quant.quantize import QuantizeOptions, quantize_model
    from optkit.weights.schemes import WeightScheme

    out = tmp_path_factory.mktemp("artifacts") / "draft-w2"
    quantize_model(draft_dir, out, QuantizeOptions(weights=WeightScheme(bits=2, group_size=-1)))
    return out


@pytest.fixture
def run_cli(monkeypatch, capsys):
    """Run `optkit ARGS...` in this process; returns (exit code, stdout, stderr)."""
    from optkit.cli.main import main

    def run(*args: str) -> tuple[int, str, str]:
        monkeypatch.setattr(sys, "argv", ["optkit", *map(str, args)])
        code = 0
        try:
            main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        out, err = capsys.readouterr()
        return code, out, err

    return run


def leftovers(parent: Path, name: str) -> list[Path]:
    """Anything at `parent/name` or a temporary sibling of it."""
    return [p for p in parent.iterdir() if p.name == name or p.name.startswith(f".{name}.")]
