"""Does an artifact load in transformers, completely, and compute what optkit's runtime computes?

"Loads" means: `from_pretrained` raises nothing, reports no missing, unexpected or mismatched
keys, logs no "newly initialized" weights (transformers fills those with random values), and its
fp32 logits on a few token sequences lie within `tolerance` of the runtime's on the same artifact.
"""

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

# max |logits_transformers - logits_runtime| <= ATOL + RTOL * max |logits_runtime|. Weight-only:
# both dequantize the same integers with the same scales in fp32, only the summation order differs.
# W8A8: transformers fake-quantizes activations per token with compressed-tensors' scale
# amax / 127.5 (calculate_qparams: bit_range / 2), the runtime (like vLLM's scaled_int8_quant) with
# amax / 127, so activations round differently: a difference of the size of int8 activation noise.
# FP8 (float-quantized): the same scale amax / 448 on both sides, but an E4M3 step is 1/8 of the
# value, so a one-ulp difference in x / scale that flips one rounding moves a logit visibly.
# The gaps measured on the reference and tiny models are in docs/results.md.
ATOL = 1e-3
RTOL = {False: 1e-4, True: 5e-2}  # w8a8 -> relative tolerance
# bitsandbytes (NF4): transformers 5 keeps the checkpoint's bf16 for the tensors it does not quantize
# (embeddings, norms) even when asked for fp32, so its logits sit within bf16 rounding of the
# runtime's (docs/results.md); the NF4 weights themselves dequantize exactly.
BNB_RTOL = 3e-2


@dataclass
class LoadCheck:
    loaded: bool
    problems: list[str] = field(default_factory=list)
    max_abs_diff: float | None = None
    tolerance: float | None = None
    logits_scale: float | None = None  # max |logits| of the runtime

    @property
    def ok(self) -> bool:
        return self.loaded and not self.problems


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def load_transformers(path: Path, **kwargs) -> tuple[torch.nn.Module | None, list[str]]:
    """(model or None, problems) from `AutoModelForCausalLM.from_pretrained(path)` in fp32."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from optkit.modeldir import verify_weights

    verify_weights(path)  # transformers reads the weight files optkit would, and no file it refuses
    records = _Records()
    logger = hf_logging.get_logger("transformers")
    logger.addHandler(records)
    hf_logging.disable_progress_bar()
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, output_loading_info=True, trust_remote_code=False, **kwargs
        )
    except Exception as e:  # any failure of the loader is the finding, not a crash of the check
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        report = [line.strip() for m in records.messages for line in m.splitlines() if "| MISMATCH" in line]
        return None, [
            f"from_pretrained raised {type(e).__name__}: {first}"[:300],
            *[" ".join(r.split()) for r in report[:1]],
        ]
    finally:
        logger.removeHandler(records)
    problems = [f"{kind}: {', '.join(sorted(map(str, keys))[:3])}" for kind, keys in info.items() if keys]
    problems += [m.splitlines()[0] for m in records.messages if "newly initialized" in m]
    return model.eval(), problems


@torch.inference_mode()
def runtime_logits(path: Path, sequences: list[list[int]]) -> list[torch.Tensor]:
    """fp32 logits [len, vocab] of every position, from optkit's runtime (one prefill each), with its
    reference kernels: the matrix checks the artifact's semantics; the CPU int4 kernel's bf16 rounding
    is bounded by tests/models/test_loader.py."""
    from optkit.kernels import cpu_int4
    from optkit.kernels.paged_attention import AttentionMetadata
    from optkit.models.llama import allocate_kv_caches
    from optkit.models.loader import load_runtime_model

    model = load_runtime_model(path)
    block_size, out = 16, []
    for seq in sequences:
        model.set_context_limit(len(seq))  # LongRoPE's factors, chosen by the length as transformers does
        blocks = math.ceil(len(seq) / block_size)
        caches = allocate_kv_caches(model.config, blocks, block_size, torch.float32)
        meta = AttentionMetadata.build([len(seq)], [len(seq)], [list(range(blocks))], list(range(len(seq))), "cpu")
        with cpu_int4.reference_only():
            hidden = model(torch.tensor(seq), torch.arange(len(seq)), meta, caches)
        out.append(model.compute_logits(hidden))
    return out


def sample_sequences(vocab_size: int, lengths: tuple[int, ...] = (17, 5, 32), seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def _uncap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """The logits before a soft-cap c·tanh(x / c)."""
    return cap * torch.atanh((logits / cap).clamp(-1 + 1e-6, 1 - 1e-6))


def check_transformers_load(
    path: Path, sequences: list[list[int]] | None = None, rtol: float | None = None, **kwargs
) -> LoadCheck:
    """Load `path` in transformers and compare its logits with the runtime's (see the module doc);
    rtol overrides the relative tolerance, kwargs go to `from_pretrained`."""
    from optkit.modeldir import read_config
    from optkit.quant.formats import reader_for

    config = read_config(path)
    model, problems = load_transformers(path, **kwargs)
    if model is None:
        return LoadCheck(False, problems)
    from optkit.models.config import ModelConfig

    runtime_config = ModelConfig.from_hf(config)
    if sequences is None:  # the vocabulary as the runtime reads it (Gemma 3 keeps it in text_config)
        sequences = sample_sequences(runtime_config.vocab_size)
    quant_config = config.get("quantization_config", {})
    w8a8 = bool(quant_config) and reader_for(quant_config, str(path)).is_w8a8(quant_config)
    if rtol is None and quant_config.get("quant_method") == "bitsandbytes":
        rtol = BNB_RTOL
    expected = runtime_logits(path, sequences)
    with torch.inference_mode():
        got = [model(torch.tensor([s])).logits[0].float() for s in sequences]
    cap = runtime_config.final_logit_softcapping
    if cap is not None:  # Gemma 2: compare before c·tanh(x / c), which squeezes the logits' scale but not the noise
        got, expected = ([_uncap(t, cap) for t in logits] for logits in (got, expected))
    diff = max((g - e).abs().max().item() for g, e in zip(got, expected, strict=True))
    scale = max(e.abs().max().item() for e in expected)
    tolerance = ATOL + (RTOL[w8a8] if rtol is None else rtol) * scale
    if not diff <= tolerance:  # also catches NaN
        problems.append(f"logits differ from optkit's runtime by {diff:.3g} (tolerance {tolerance:.3g})")
    return LoadCheck(True, problems, diff, tolerance, scale)
