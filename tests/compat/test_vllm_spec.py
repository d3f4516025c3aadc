"""The vLLM spec check catches what vLLM would refuse: names, shapes, dtypes, unsupported kinds."""

import torch

from optkit.compat.vllm_spec import check_vllm_spec

OUT, IN, GROUP = 64, 128, 32


def _ct_config(bits: int, symmetric: bool) -> dict:
    weights = {"num_bits": bits, "symmetric": symmetric, "strategy": "group", "group_size": GROUP}
    return {
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"weights": weights}},
        }
    }


def _ct_tensors(bits: int, symmetric: bool) -> dict[str, torch.Tensor]:
    p = "layer"
    tensors = {
        f"{p}.weight_packed": torch.zeros(OUT, IN * bits // 32, dtype=torch.int32),
        f"{p}.weight_scale": torch.ones(OUT, IN // GROUP, dtype=torch.bfloat16),
        f"{p}.weight_shape": torch.tensor([OUT, IN]),
    }
    if not symmetric:
        tensors[f"{p}.weight_zero_point"] = torch.zeros(OUT * bits // 32, IN // GROUP, dtype=torch.int32)
    return tensors


def test_the_standard_packed_layout_passes():
    for symmetric in (True, False):
        assert check_vllm_spec(_ct_config(4, symmetric), _ct_tensors(4, symmetric), {"layer": (OUT, IN)}) == []


def test_unpacked_zero_points_missing_keys_and_wrong_dtypes_are_named():
    tensors = _ct_tensors(4, False)
    tensors["layer.weight_zero_point"] = torch.zeros(OUT, IN // GROUP, dtype=torch.int32)  # not packed
    tensors["layer.weight_packed"] = tensors["layer.weight_packed"].to(torch.int64)
    del tensors["layer.weight_shape"]
    problems = check_vllm_spec(_ct_config(4, False), tensors, {"layer": (OUT, IN)})
    assert any("weight_zero_point has shape (64, 4)" in p for p in problems)
    assert any("weight_packed is torch.int64" in p for p in problems)
    assert any("weight_shape missing" in p for p in problems)


def test_asymmetric_three_bits_has_no_vllm_loader():
    problems = check_vllm_spec(_ct_config(3, False), {}, {"layer": (OUT, IN)})
    assert len(problems) == 1 and "no loader" in problems[0]


def test_gptq_config_keys_are_required():
    config = {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "sym": True}}
    problems = check_vllm_spec(config, {}, {})
    assert problems == ["quantization_config lacks 'desc_act'"]
