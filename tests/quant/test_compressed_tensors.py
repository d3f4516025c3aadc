import pytest
import torch
from compressed_tensors.compressors import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationConfig

from optkit.quant.formats import compressed_tensors as ct
from optkit.quant.methods.rtn.math import rtn_quantize
from optkit.weights.schemes import WeightScheme


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", [32, -1])
def test_round_trip_is_exact(bits, symmetric, group_size):
    scheme = WeightScheme(bits=bits, group_size=group_size, symmetric=symmetric)
    qw = rtn_quantize(torch.randn(40, 96), scheme)
    back = ct.decompress("layer", ct.compress("layer", qw), scheme)
    assert torch.equal(back.q, qw.q)
    assert torch.equal(back.scale, qw.scale)
    assert torch.equal(back.zero_point, qw.zero_point)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_the_compressed_tensors_library_reads_our_tensors(bits, symmetric):
    """The library's own decompressor (what transformers and vLLM rely on) gives our weights."""
    scheme = WeightScheme(bits=bits, group_size=32, symmetric=symmetric)
    qw = rtn_quantize(torch.randn(64, 128), scheme, scale_dtype=torch.float32)
    config = QuantizationConfig.model_validate(ct.quantization_config(scheme, False, ["lm_head"]))
    library_scheme = config.config_groups["group_0"]
    tensors = {k.removeprefix("p."): v for k, v in ct.compress("p", qw).items()}
    decompressed = PackedQuantizationCompressor.decompress(tensors, library_scheme)["weight"]
    torch.testing.assert_close(decompressed.float(), qw.dequantize(), rtol=0, atol=1e-6)


def test_config_names_format_and_scheme():
    config = ct.quantization_config(WeightScheme(bits=4, group_size=128, symmetric=True), False, ["lm_head"])
    assert config["quant_method"] == "compressed-tensors"
    assert config["format"] == "pack-quantized"
    assert config["quantization_status"] == "compressed"
    assert config["ignore"] == ["lm_head"]
    weights = config["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["group_size"], weights["strategy"]) == (4, 128, "group")
    assert ct.scheme_from_config(config) == WeightScheme(bits=4, group_size=128, symmetric=True)
    per_channel = ct.quantization_config(WeightScheme(group_size=-1), False, [])
    assert per_channel["config_groups"]["group_0"]["weights"]["strategy"] == "channel"
    assert ct.scheme_from_config(per_channel).group_size == -1
