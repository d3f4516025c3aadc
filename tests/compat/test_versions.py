"""The version data of the matrix: warnings follow what was measured, and only where they apply."""

import pytest

from optkit.compat import matrix
from optkit.families import family_for, model_types
from optkit.quant.formats.kind import ArtifactKind

ASYM = ArtifactKind("compressed-tensors", 4, False)
BROKEN = {"transformers": "5.24.0", "compressed-tensors": "0.20.1"}
MOE_MODEL_TYPES = [t for t in model_types() if family_for(t).moe is not None]


@pytest.mark.parametrize("breakage", matrix.BREAKAGES, ids=lambda b: b.summary[:30])
def test_each_breakage_range_agrees_with_the_versions_measured(breakage):
    assert breakage.measured_ok and breakage.measured_broken
    assert not any(breakage.is_broken(v) for v in breakage.measured_ok)
    assert all(breakage.is_broken(v) for v in breakage.measured_broken)
    # every package of the range was seen to matter: flipping any one of them alone un-breaks it
    for package in breakage.broken:
        assert any(
            ok[package] != bad[package]
            and {k: v for k, v in ok.items() if k != package} == {k: v for k, v in bad.items() if k != package}
            for ok in breakage.measured_ok
            for bad in breakage.measured_broken
        ), package


def test_quantize_warns_in_one_line_only_for_the_versions_that_break():
    assert matrix.check_installed_versions(ASYM, {**BROKEN, "transformers": "5.22.2"}) is None
    assert matrix.check_installed_versions(ASYM, {**BROKEN, "compressed-tensors": "0.17.1"}) is None
    warning = matrix.check_installed_versions(ASYM, BROKEN)
    assert "transformers 5.24.0 with compressed-tensors 0.20.1" in warning
    assert "--sym" in warning and "\n" not in warning
    assert "--format awq" in warning and "vLLM reads it" in warning


def test_no_warning_for_what_transformers_loads():
    for kind in (
        ArtifactKind("compressed-tensors", 4, True),
        ArtifactKind("compressed-tensors", 8, True, w8a8=True),
        ArtifactKind("awq", 4, False),
        ArtifactKind("gptq", 4, True),
    ):
        assert matrix.check_installed_versions(kind, BROKEN) is None


def test_three_bit_asymmetric_warning_offers_neither_awq_nor_vllm():
    warning = matrix.check_installed_versions(ArtifactKind("compressed-tensors", 3, False), BROKEN)
    assert "--format awq" not in warning and "vLLM" not in warning


def test_kind_is_read_back_from_each_formats_config():
    ct = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": {"weights": {"num_bits": 3, "symmetric": False}}},
    }
    assert matrix.kind_from_quant_config(ct) == ArtifactKind("compressed-tensors", 3, False)
    assert matrix.kind_from_quant_config({"quant_method": "gptq", "bits": 8, "sym": True}) == ArtifactKind(
        "gptq", 8, True
    )


def test_where_it_loads_names_every_loader_and_the_remedy():
    rows = dict(matrix.where_it_loads(ASYM, BROKEN))
    assert set(rows) == set(matrix.LOADERS)
    assert rows[matrix.TRANSFORMERS].startswith("fails") and "dequantize=True" in rows[matrix.TRANSFORMERS]
    assert rows[matrix.VLLM].startswith("by spec")
    assert dict(matrix.where_it_loads(ASYM, {**BROKEN, "transformers": "5.22.2"}))[matrix.TRANSFORMERS] == "loads"


@pytest.mark.parametrize("model_type", MOE_MODEL_TYPES)
def test_quantizing_a_moe_model_into_a_format_transformers_reads_warns_that_it_cannot_load_it(model_type):
    for kind in (ArtifactKind("compressed-tensors", 4, True), ArtifactKind("compressed-tensors", 8, True, w8a8=True)):
        warning = matrix.check_installed_versions(kind, BROKEN, model_type)
        assert warning.startswith(f"transformers 5.24.0 cannot load {model_type} (mixture-of-experts) ")
        assert matrix.MOE_TRANSFORMERS.summary in warning and "\n" not in warning
        assert "optkit or vLLM" in warning and "--format awq" not in warning
    # nothing to say where transformers would not load it anyway, or before transformers 5
    assert matrix.check_installed_versions(ArtifactKind("gptq", 4, True), BROKEN, model_type) is None
    assert (
        matrix.check_installed_versions(
            ArtifactKind("compressed-tensors", 4, True), {"transformers": "4.57.1"}, model_type
        )
        is None
    )
    assert matrix.check_installed_versions(ArtifactKind("compressed-tensors", 4, True), BROKEN, "llama") is None


@pytest.mark.parametrize("model_type", MOE_MODEL_TYPES)
def test_an_nf4_moe_artifact_is_expected_to_fail_in_transformers_with_its_own_reason(model_type):
    nf4 = ArtifactKind("bitsandbytes", 4, True, type="nf4")
    assert matrix.expected_status(nf4, matrix.TRANSFORMERS, BROKEN, model_type) == "fails"
    assert matrix.expected_status(nf4, matrix.OPTKIT, BROKEN, model_type) == "loads"
    warning = matrix.check_installed_versions(nf4, BROKEN, model_type)
    assert matrix.MOE_TRANSFORMERS_NF4.summary in warning and matrix.MOE_TRANSFORMERS.summary not in warning
    rows = dict(matrix.where_it_loads(nf4, BROKEN, model_type))
    assert rows[matrix.TRANSFORMERS].startswith("fails") and "size MISMATCH" in rows[matrix.TRANSFORMERS]
    # a dense model's NF4 artifact: no family breakage
    assert matrix.check_installed_versions(nf4, BROKEN, "llama") is None
