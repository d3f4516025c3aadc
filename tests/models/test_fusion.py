"""Fused projections (q/k/v as one linear, gate/up as another) compute what the separate linears do."""

import pytest
import torch

from optkit.kernels.packed_int import PackedIntLinear
from optkit.kernels.w8a8 import W8A8Linear
from optkit.models.fusion import fuse_projections
from optkit.models.loader import load_runtime_model
from optkit.quant.calibration_data import CalibrationOptions
from optkit.quant.quantize import QuantizeOptions, quantize_model
from optkit.weights.schemes import W8_PER_CHANNEL, WeightScheme
from tests.models.paged import chunked_then_decode, prompts, run_paged, whole_prefills

LENGTHS = [5, 37, 120]  # prefills under and over cpu_int4.MAX_KERNEL_ROWS, chunks of up to 40, decodes
ARTIFACTS = {
    "w4a16": (QuantizeOptions(weights=WeightScheme(bits=4, group_size=64, symmetric=False)), PackedIntLinear),
    "w8a8": (
        QuantizeOptions(
            method="w8a8", weights=W8_PER_CHANNEL, calibration=CalibrationOptions(num_samples=8, seq_len=64)
        ),
        W8A8Linear,
    ),
}


@pytest.fixture(scope="module")
def token_prompts(small_dir):
    from optkit.modeldir import load_tokenizer

    return prompts(load_tokenizer(small_dir), LENGTHS)


def fused_layers(model) -> list[tuple[str, torch.nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if n.endswith(("qkv_proj", "gate_up_proj"))]


def logits_both_ways(path, token_prompts) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    fused, separate = load_runtime_model(path), load_runtime_model(path, fuse=False)
    assert len(fused_layers(fused)) == 2 * fused.config.num_hidden_layers and not fused_layers(separate)
    # the prompts twice: whole prefills, then (as sequences 3..5) chunked prefills and decodes
    chunked = [[(i + len(LENGTHS), n) for i, n in step] for step in chunked_then_decode(LENGTHS)]
    steps = whole_prefills(LENGTHS) + chunked
    return run_paged(fused, token_prompts * 2, steps), run_paged(separate, token_prompts * 2, steps)


def test_fused_full_precision_equals_the_separate_linears_within_fp32(small_dir, token_prompts):
    """One GEMM over the concatenated weight may sum in another order: fp32 rounding, no more."""
    fused, separate = logits_both_ways(small_dir, token_prompts)
    for got, want in zip(fused, separate, strict=True):
        assert (got - want).abs().max().item() < 1e-4
        assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("name", ARTIFACTS)
def test_fused_quantized_layers_equal_the_separate_ones(tmp_path, draft_dir, token_prompts, name):
    """The integer kernels compute each output column alone: fused or not, the same logits."""
    options, layer_class = ARTIFACTS[name]
    quantize_model(str(draft_dir), tmp_path / name, options)
    fused, separate = logits_both_ways(tmp_path / name, token_prompts)
    for got, want in zip(fused, separate, strict=True):
        assert torch.equal(got, want)
    model = load_runtime_model(tmp_path / name)
    assert all(isinstance(m, layer_class) for _, m in fused_layers(model))


def test_layers_of_different_layouts_stay_separate(tmp_path, draft_dir):
    """A mixed artifact whose k_proj is 8-bit among 4-bit layers: that attention keeps q, k and v apart."""
    path = tmp_path / "w4"
    quantize_model(str(draft_dir), path, QuantizeOptions(weights=WeightScheme(bits=4, group_size=64)))
    model = load_runtime_model(path, fuse=False)
    attention = model.model.layers[0].self_attn
    eight_bit = PackedIntLinear.from_quantized(_requantized(attention.k_proj, bits=8))
    attention.k_proj = eight_bit
    fused = fuse_projections(model)
    assert fused == 2 * model.config.num_hidden_layers - 1
    assert attention.qkv_proj is None and attention.k_proj is eight_bit


def _requantized(layer: PackedIntLinear, bits: int):
    """The layer's dequantized weight, quantized again per channel at `bits`."""
    from optkit.quant.methods.rtn.math import rtn_quantize

    return rtn_quantize(layer.dequantized_weight(), WeightScheme(bits=bits, group_size=-1))
