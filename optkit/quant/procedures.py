"""What each calibrated method does to one decoder layer (the layer loop is in calibrate.py).

A procedure gets a `LayerWork`, quantizes the target linears of that layer, leaves the layer
holding the dequantized weights (so the next layer is calibrated on quantized outputs) and
returns local name -> (QuantizedWeight, stats).
"""

import logging

import torch

from optkit.quant.calibrate import LayerProcedure, LayerWork, capture_hessians, sequential_groups
from optkit.quant.gptq import GPTQOptions, gptq_quantize, output_error
from optkit.quant.rtn import rtn_quantize, weight_error
from optkit.weights.quantized import QuantizedWeight
from optkit.weights.schemes import WeightScheme

SCALE_DTYPE = torch.bfloat16  # layers are calibrated in fp32; scales are stored as in bf16 checkpoints
log = logging.getLogger(__name__)


def too_few_tokens(work: LayerWork, name: str, method: str) -> bool:
    """Whether an expert's linear saw fewer calibration tokens than its threshold (it then gets
    RTN); says so in one warning naming it."""
    minimum = work.min_tokens.get(name)
    if minimum is None or work.tokens_seen.get(name, 0) >= minimum:
        return False
    log.warning(
        "%s.%s: %d calibration tokens reached this expert, fewer than %d: quantized with RTN instead of %s "
        "(more --num-samples, --moe-calibration all, or a lower moe_min_tokens)",
        work.prefix,
        name,
        work.tokens_seen.get(name, 0),
        minimum,
        method,
    )
    return True


def set_quantized(work: LayerWork, name: str, qw: QuantizedWeight) -> None:
    work.layer.get_submodule(name).weight.copy_(qw.dequantize().to(work.device))


def count_tokens(work: LayerWork, names: list[str]) -> None:
    """work.tokens_seen[name]: the calibration tokens that reach each named linear (an expert's,
    in --moe-calibration routed, only those the router sends it)."""
    counts = dict.fromkeys(names, 0)

    def on_input(name: str, x: torch.Tensor, owner: str) -> None:
        counts[name] += x.reshape(-1, x.shape[-1]).shape[0]

    work.run_until_seen(names, on_input)
    work.tokens_seen.update(counts)


def gptq_procedure(scheme: WeightScheme, options: GPTQOptions) -> LayerProcedure:
    """True-sequential GPTQ: each group's Hessians come from the already-quantized groups before it."""

    def procedure(work: LayerWork) -> dict[str, tuple[QuantizedWeight, dict]]:
        results = {}
        for group in sequential_groups(work.layer, work.family):
            group = [n for n in group if n in work.targets]
            if not group:
                continue
            hessians = capture_hessians(work, group)
            for name in group:
                weight = work.layer.get_submodule(name).weight.detach()
                hessian = hessians.pop(name)
                full_name = f"{work.prefix}.{name}"
                rtn_qw = rtn_quantize(weight, scheme, SCALE_DTYPE)
                rtn_w = rtn_qw.dequantize().to(weight.device)
                if too_few_tokens(work, name, "GPTQ"):
                    qw, stats = rtn_qw, {"loss": output_error(weight, rtn_w, hessian), "fallback": "rtn"}
                else:
                    result = gptq_quantize(weight, hessian, scheme, options, scale_dtype=SCALE_DTYPE, name=full_name)
                    qw = result.weight
                    stats = {"loss": result.loss, "rtn_loss": output_error(weight, rtn_w, hessian), "damp": result.damp}
                if name in work.tokens_seen and name in work.min_tokens:
                    stats["calibration_tokens"] = work.tokens_seen[name]
                stats.update(weight_error(weight.cpu(), qw.dequantize()))
                set_quantized(work, name, qw)
                results[name] = (qw, stats)
                work.report(name, stats)
        return results

    return procedure


def fold_scale(
    layer: torch.nn.Module, previous: str, linears: tuple[str, ...], s: torch.Tensor, norm_offset: float = 0.0
) -> None:
    """W_i ← W_i diag(s) for each linear, and the previous operation's output channels ← / s. A norm
    that scales by (norm_offset + w) (Gemma's 1 + w) gets w ← (norm_offset + w)/s − norm_offset."""
    prev = layer.get_submodule(previous)
    if isinstance(prev, torch.nn.Linear):
        prev.weight.div_(s.view(-1, 1))
        if prev.bias is not None:
            prev.bias.div_(s)
    elif norm_offset:  # y = norm(x) · (offset + weight)
        prev.weight.copy_((prev.weight + norm_offset) / s - norm_offset)
        if getattr(prev, "bias", None) is not None:
            prev.bias.div_(s)
    else:  # RMSNorm / LayerNorm: y = norm(x) * weight
        prev.weight.div_(s)
        if getattr(prev, "bias", None) is not None:
            prev.bias.div_(s)
    for name in linears:
        layer.get_submodule(name).weight.mul_(s.view(1, -1))


def block_output(work: LayerWork, block: str, x: torch.Tensor) -> torch.Tensor:
    """The output of `block` (a module of the layer) for inputs x ([S, L, in]), run `batch_size`
    samples at a time like the rest of the calibration: the block's intermediates (the MLP's
    [S, L, intermediate]) never exist for all S samples at once, only its output does."""
    out = None
    for start, y in _block_outputs(work, block, x):
        if out is None:
            out = y.new_empty(x.shape[0], *y.shape[1:])
        out[start : start + y.shape[0]] = y
    return out


def block_error(work: LayerWork, block: str, x: torch.Tensor, reference: torch.Tensor) -> float:
    """mean((block(x) − reference)²), batch by batch: no output-sized temporaries."""
    total = 0.0
    for start, y in _block_outputs(work, block, x):
        total += (y - reference[start : start + y.shape[0]]).pow_(2).sum().item()
    return total / reference.numel()


def sample_errors(work: LayerWork, block: str, x: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """mean((block(x) − reference)²) of each sample of x: [S], batch by batch."""
    errors = []
    for start, y in _block_outputs(work, block, x):
        diff = (y - reference[start : start + y.shape[0]]).pow_(2)
        errors.append(diff.reshape(diff.shape[0], -1).mean(dim=1).cpu())
    return torch.cat(errors)


def _block_outputs(work: LayerWork, block: str, x: torch.Tensor):
    """(first sample, output) for each batch of `work.batch_size` samples of x."""
    module = work.layer.get_submodule(block)
    for start in range(0, x.shape[0], work.batch_size):
        chunk = x[start : start + work.batch_size]
        if block.endswith("self_attn"):
            out = module(hidden_states=chunk, position_embeddings=work.rope, attention_mask=work.attention_mask)
            yield start, out[0]
        else:
            yield start, module(chunk)
