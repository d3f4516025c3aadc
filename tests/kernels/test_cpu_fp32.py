"""fp32 CPU linears through oneDNN's packed weights (kernels/cpu_fp32.py): within float32 rounding of
F.linear at every row count, a row's output independent of the call's other rows, the weight kept
once and read back bit for bit, and the choice set by OPTKIT_CPU_FP32_GEMM or the CPU's vendor."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from optkit.errors import OptkitError
from optkit.kernels import cpu_fp32

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this PyTorch has no oneDNN")


def linear(out_features=96, in_features=80, bias=True) -> nn.Linear:
    torch.manual_seed(0)
    layer = nn.Linear(in_features, out_features, bias=bias).requires_grad_(False)
    layer.weight.mul_(3.0)
    return layer


@pytest.mark.parametrize("rows", [1, 3, 32, 200])
@pytest.mark.parametrize("bias", [True, False])
def test_the_packed_linear_computes_f_linear_within_float32_rounding(rows, bias):
    plain = linear(bias=bias)
    packed = cpu_fp32.PackedFp32Linear.from_linear(plain)
    x = torch.randn(rows, plain.in_features, generator=torch.Generator().manual_seed(rows))
    got, want = packed(x), F.linear(x, plain.weight, plain.bias)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    three_d = packed(x[None])  # [1, rows, in]: any leading dims, as nn.Linear takes
    torch.testing.assert_close(three_d[0], want, rtol=1e-5, atol=1e-5)


def test_a_rows_output_does_not_depend_on_the_calls_other_rows():
    packed = cpu_fp32.PackedFp32Linear.from_linear(linear())
    x = torch.randn(200, packed.in_features, generator=torch.Generator().manual_seed(1))
    batched = packed(x)
    for i in (0, 5, 199):
        assert torch.equal(packed(x[i : i + 1]), batched[i : i + 1])


def test_the_weight_is_kept_once_and_reads_back_bit_for_bit():
    plain = linear()
    packed = cpu_fp32.PackedFp32Linear.from_linear(plain)
    assert torch.equal(packed.weight, plain.weight)
    assert [name for name, _ in packed.named_parameters()] == ["bias"]  # the packed tensor is no parameter


@pytest.mark.parametrize("setting, swapped", [("onednn", True), ("mkl", False)])
def test_the_setting_chooses_the_runtime_models_fp32_linears(small_dir, monkeypatch, setting, swapped):
    from optkit.models.loader import load_runtime_model

    monkeypatch.setenv("OPTKIT_CPU_FP32_GEMM", setting)
    monkeypatch.setattr(cpu_fp32, "chosen", cpu_fp32.chosen.__wrapped__)

    def kinds(model) -> set[type]:
        return {type(m) for m in model.modules() if isinstance(m, (nn.Linear, cpu_fp32.PackedFp32Linear))}

    assert kinds(load_runtime_model(small_dir)) == ({cpu_fp32.PackedFp32Linear} if swapped else {nn.Linear})
    assert kinds(load_runtime_model(small_dir, prepare=False)) == {nn.Linear}  # the gate's windows: MKL


def test_an_unknown_setting_says_what_to_set(monkeypatch):
    monkeypatch.setenv("OPTKIT_CPU_FP32_GEMM", "blas")
    with pytest.raises(OptkitError, match="OPTKIT_CPU_FP32_GEMM='blas': set it to onednn or mkl"):
        cpu_fp32.chosen.__wrapped__()


def test_cpus_not_made_by_intel_take_onednn(monkeypatch):
    monkeypatch.delenv("OPTKIT_CPU_FP32_GEMM", raising=False)
    for vendor, want in [("AuthenticAMD", True), ("GenuineIntel", False), ("", False)]:
        monkeypatch.setattr(cpu_fp32, "cpu_vendor", lambda vendor=vendor: vendor)
        assert cpu_fp32.chosen.__wrapped__() is want
