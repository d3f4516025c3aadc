from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def small_w2(tmp_path_factory, small_dir) -> Path:
    """RTN 2-bit per channel of `small`: the quantized model of the shadow-mode acceptance."""
    from optkit.quant.quantize import QuantizeOptions, quantize_model
    from optkit.weights.schemes import WeightScheme

    out = tmp_path_factory.mktemp("artifacts") / "small-w2"
    quantize_model(small_dir, out, QuantizeOptions(weights=WeightScheme(bits=2, group_size=-1)))
    return out
