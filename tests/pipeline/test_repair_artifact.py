"""What repair climbs for a GGUF file (pipeline/repair_artifact.py): ggml's types by default, a
K mix only, and `start: smallest` on the smallest type's file type."""

import pytest

from optkit.errors import OptkitError
from optkit.gate.options import GateOptions, RepairOptions
from optkit.pipeline.repair import start_options
from optkit.pipeline.repair_artifact import check_repairable, repair_rungs
from optkit.quant.ladder import DEFAULT_LADDER, GGUF_LADDER, parse_rung
from optkit.quant.quantize import QuantizeOptions
from optkit.weights.stored import k_scheme


def test_a_gguf_file_climbs_ggmls_types_unless_the_recipe_names_them():
    assert repair_rungs(RepairOptions(), gguf=True) == [parse_rung(x) for x in GGUF_LADDER]
    assert repair_rungs(RepairOptions(), gguf=False) == [parse_rung(x) for x in DEFAULT_LADDER]
    chosen = RepairOptions(precisions=["Q4_K", "Q6_K", 16])
    assert [r.label for r in repair_rungs(chosen, gguf=True)] == ["Q4_K", "Q6_K", "16"]
    with pytest.raises(OptkitError, match="gate.repair.precisions.*ggml's types"):
        repair_rungs(RepairOptions(precisions=["w4g32", 16]), gguf=True)


@pytest.mark.parametrize("file_type", ["Q4_0", "Q4_1", "Q8_0", None])
def test_repair_refuses_a_legacy_gguf_file_in_one_line(file_type):
    with pytest.raises(OptkitError, match="K-quant ladder.*Q4_K_M"):
        check_repairable("gguf", {"type": file_type} if file_type else None)
    check_repairable("gguf", {"type": "Q3_K_M"})
    with pytest.raises(OptkitError, match="--format awq has no per-layer precision"):
        check_repairable("awq", None)


def test_start_smallest_quantizes_a_gguf_release_in_the_smallest_types_file_type():
    options = QuantizeOptions(method="rtn", format="gguf", gguf={"type": "Q4_K_M"})
    smallest = start_options(options, GateOptions(max_kld=0.01, repair=RepairOptions(start="smallest")))
    assert smallest.gguf.type == "Q2_K" and smallest.weights == k_scheme("Q2_K")
    from_q4 = RepairOptions(start="smallest", precisions=["Q4_K", "Q8_0", 16])
    assert start_options(options, GateOptions(max_kld=0.01, repair=from_q4)).gguf.type == "Q4_K_S"


def test_quantize_target_kld_names_optkit_run_for_a_gguf_file(tmp_path):
    from optkit.pipeline.repair import quantize_and_repair

    options = QuantizeOptions(method="rtn", format="gguf", gguf={"type": "Q3_K_M"})
    with pytest.raises(OptkitError, match="gate.repair in a recipe"):
        quantize_and_repair("small", tmp_path / "m.gguf", options, GateOptions(max_kld=0.004))
    assert not list(tmp_path.iterdir())
