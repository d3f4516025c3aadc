"""Layer-by-layer calibration, so that models bigger than memory still fit.

Only one decoder layer is materialised (on the compute device) at a time; the inputs of that
layer for every calibration sample are cached on the CPU. Inside a layer the linear modules
are calibrated in true-sequential order (q/k/v, then o, then gate/up, then down), each on the
inputs produced by the already-quantized sublayers before it; then the quantized layer runs
once more and its outputs become the next layer's inputs (the sequential scheme of GPTQ's
reference code). What a method does to one layer is a `LayerProcedure` (its step in
quant/methods/NAME/, run through quant/layer_step.py); each layer's results are handed to the
caller as soon as the layer is done, so that they can be written out instead of accumulating.
"""

import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from optkit.errors import OptkitError
from optkit.families import Family, expand_group, family_for
from optkit.modeldir import TensorReader
from optkit.progress import progress_bar
from optkit.quant.moe import (
    calibration_modules,
    expert_min_tokens,
    record_routed_tokens,
    token_weight,
    unfuse_experts,
)
from optkit.weights.quantized import QuantizedWeight
from optkit.weights.schemes import WeightScheme


class LayerStream:
    """A causal LM read one decoder layer at a time from its safetensors."""

    def __init__(self, path, device: torch.device, moe_calibration: str = "all"):
        from transformers import AutoConfig, AutoModelForCausalLM

        self.config = AutoConfig.from_pretrained(path, trust_remote_code=False)
        with torch.device("meta"):
            try:
                skeleton = AutoModelForCausalLM.from_config(self.config, attn_implementation="sdpa")
            except ValueError:  # Gemma 2: transformers has no SDPA path with soft-capping
                skeleton = AutoModelForCausalLM.from_config(self.config, attn_implementation="eager")
        self.decoder = skeleton.get_decoder()
        # the decoder's module name: "model", or "model.language_model" (Gemma 3 with its vision tower)
        self.prefix = next(name for name, module in skeleton.named_modules() if module is self.decoder)
        self.text_config = self.decoder.config
        self._layer_inputs: dict[tuple[str | None, int], tuple] = {}
        self.family = family_for(self.config.model_type)
        if self.family.moe is not None:  # per-expert linears in place of transformers' fused experts
            unfuse_experts(self.decoder.layers, self.family, self.config.to_dict(), moe_calibration)
        self.reader = TensorReader(path)
        self.device = device

    @property
    def num_layers(self) -> int:
        return len(self.decoder.layers)

    def layer_name(self, index: int) -> str:
        return f"{self.prefix}.layers.{index}"

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """[N, L] token ids -> [N, L, hidden] fp32 on the CPU: the first decoder layer's inputs.

        Rows are looked up in the stored dtype and widened sample by sample into the cache,
        so no fp32 copy of the embedding matrix is made (widening is exact)."""
        weight = self.reader.get(self.family.checkpoint_name(f"{self.prefix}.embed_tokens.weight"))  # [vocab, hidden]
        hidden = torch.empty(*tokens.shape, weight.shape[1], dtype=torch.float32)
        for sample, ids in zip(hidden, tokens, strict=True):
            sample.copy_(torch.nn.functional.embedding(ids, weight))
        scale = family_for(self.config.model_type).embedding_scale
        if scale is not None:  # the model scales its embeddings before the first layer (Granite)
            hidden.mul_(scale(self.config))
        return hidden

    def position_embeddings(self, seq_len: int, layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of positions 0..seq_len-1 (of the layer type's RoPE: Gemma 3's local base)."""
        rotary = type(self.decoder.rotary_emb)(self.text_config).to(self.device)
        positions = torch.arange(seq_len, device=self.device)[None]
        by_type = "layer_type" in inspect.signature(rotary.forward).parameters
        x = torch.zeros(1, device=self.device)
        cos, sin = rotary(x, positions, layer_type) if by_type else rotary(x, positions)
        return cos.float(), sin.float()

    def layer_inputs(self, index: int, seq_len: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor | None]:
        """The RoPE cos/sin and the attention mask decoder layer `index` takes for a sample: the mask
        is None (causal SDPA) unless the layer has a sliding window shorter than the sample or runs
        eager attention (Gemma 2), then an additive [1, 1, L, L] float32 mask."""
        layer_types = getattr(self.text_config, "layer_types", None)
        layer_type = layer_types[index] if layer_types else None
        key = (layer_type, seq_len)
        if key not in self._layer_inputs:
            window = getattr(self.text_config, "sliding_window", None) if layer_type == "sliding_attention" else None
            window = window if window is not None and window < seq_len else None
            mask = None
            if window is not None or self.text_config._attn_implementation == "eager":
                position = torch.arange(seq_len, device=self.device)
                seen = position[None, :] <= position[:, None]  # query i sees keys j <= i ...
                if window is not None:
                    seen &= position[None, :] > position[:, None] - window  # ... and j > i - window
                mask = torch.zeros(seq_len, seq_len, device=self.device)
                mask = mask.masked_fill(~seen, torch.finfo(torch.float32).min)[None, None]
            self._layer_inputs[key] = (self.position_embeddings(seq_len, layer_type), mask)
        return self._layer_inputs[key]

    def load_layer(self, index: int) -> torch.nn.Module:
        layer = self.decoder.layers[index].to_empty(device=self.device)
        stored = self.reader.get_prefixed(self.family.checkpoint_name(f"{self.layer_name(index)}."))
        layer.load_state_dict({self.family.module_name(k): v for k, v in stored.items()}, strict=True)
        return layer.float()

    def release_layer(self, index: int) -> None:
        self.decoder.layers[index].to("meta")


class _GroupCaptured(Exception):
    """Raised from a hook once every module of a group has seen its input: stop the forward."""


@dataclass
class LayerWork:
    """One decoder layer on the device and everything a method needs to calibrate it."""

    layer: torch.nn.Module
    prefix: str  # e.g. "model.layers.3"
    hidden: torch.Tensor  # [N, L, hidden] inputs of this layer, CPU
    rope: tuple[torch.Tensor, torch.Tensor]
    batch_size: int
    device: torch.device
    targets: set[str]  # local names of the linears to quantize, e.g. "mlp.up_proj"
    report: Callable[[str, dict], None]  # called once per quantized linear with its stats
    # modules whose full-precision parameters the method changed (AWQ folds scales into norms)
    updated: dict[str, torch.nn.Module] = field(default_factory=dict)
    # the model's family (families/): true-sequential order, smoothing groups
    family: Family = field(default_factory=lambda: family_for("llama"))
    # experts' linears: the fewest calibration tokens their statistics may come from (else RTN)
    min_tokens: dict[str, int] = field(default_factory=dict)
    tokens_seen: dict[str, int] = field(default_factory=dict)  # by a step's statistics, per linear
    # additive [1, 1, L, L] mask where the layer needs one (LayerStream.layer_inputs); None: causal
    attention_mask: torch.Tensor | None = None
    # linears (local names) on another scheme than the run's: a GGUF K mix's raised ones
    schemes: dict[str, WeightScheme] = field(default_factory=dict)

    def scheme_for(self, name: str, default: WeightScheme) -> WeightScheme:
        """The scheme linear `name` is quantized onto: its own, else the run's `default`."""
        return self.schemes.get(name, default)

    def forward(self, samples: torch.Tensor) -> torch.Tensor:
        out = self.layer(samples.to(self.device), position_embeddings=self.rope, attention_mask=self.attention_mask)
        return out[0] if isinstance(out, tuple) else out

    def run_until_seen(
        self, names: list[str], on_input: Callable[[str, torch.Tensor, str], None], num_samples: int | None = None
    ) -> None:
        """Run the cached samples through the layer, calling on_input(name, x, owner) with the
        input of each named module, and stop each forward once all of them have been seen.
        `owner` is the first module of `names` that got the very same tensor (q for q/k/v) with
        the same token weights (an expert's own gate/up in --moe-calibration all, quant/moe.py)."""
        seen: list[tuple[torch.Tensor, torch.Tensor | None, str]] = []

        def hook_for(name):
            def hook(module, args):
                weight = token_weight(self.layer, name)
                owner = next((n for t, w, n in seen if t is args[0] and w is weight), name)
                seen.append((args[0], weight, name))
                on_input(name, args[0].detach(), owner)
                if len(seen) == len(names):
                    raise _GroupCaptured

            return hook

        handles = [self.layer.get_submodule(n).register_forward_pre_hook(hook_for(n)) for n in names]
        samples = self.hidden if num_samples is None else self.hidden[:num_samples]
        try:
            for start in range(0, samples.shape[0], self.batch_size):
                seen.clear()
                try:
                    self.forward(samples[start : start + self.batch_size])
                except _GroupCaptured:
                    pass
        finally:
            for handle in handles:
                handle.remove()


def run_layer(
    name: str,
    layer: torch.nn.Module,
    hidden: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    batch_size: int,
    device: torch.device,
    attention_mask: torch.Tensor | None = None,
) -> None:
    """Replace every cached sample ([N, L, hidden], CPU) by the layer's output for it.

    Samples are independent, so one cache serves as both input and output of a layer."""
    for start in range(0, hidden.shape[0], batch_size):
        batch = hidden[start : start + batch_size]
        out = layer(batch.to(device), position_embeddings=rope, attention_mask=attention_mask)
        out = out[0] if isinstance(out, tuple) else out
        if not torch.isfinite(out).all():
            raise OptkitError(
                f"{name} produces NaN or inf on the calibration data: "
                "check the checkpoint, or quantize in a wider dtype"
            )
        batch.copy_(out)


def capture_inputs(
    work: LayerWork, names: list[str], num_samples: int, rows: torch.Tensor | None = None, weighted: bool = False
) -> dict[str, torch.Tensor]:
    """The inputs of each named module for the first `num_samples` samples: [S, L, in], on the
    device; modules fed the same tensor share one. With `rows` (sorted indices into those S·L
    tokens, flattened), only those tokens: [len(rows), in], the rest never held.

    `weighted`: an expert's inputs in --moe-calibration all come scaled token by token by √c_t, the
    root of the token's router weight (quant/moe.py: expert_token_weights). For a linear f the
    squared output error on √c_t x_t is c_t ‖Δf(x_t)‖²: searches that minimise a linear's output
    error then minimise the router-weighted error that GPTQ's weighted Hessian describes.

    Each batch is copied into one buffer allocated at the first batch (no list of copies to
    concatenate at the end, which would hold the inputs twice)."""
    num_samples = min(num_samples, work.hidden.shape[0])
    buffers: dict[str, torch.Tensor] = {}
    filled: dict[str, int] = {}  # tokens (rows given) or samples seen so far, per owner
    routed: dict[str, list[torch.Tensor]] = {}  # [n, in] inputs of routed experts, n varying by batch
    kept: dict[str, int] = {}  # rows given: how many of them a routed expert's tokens reached

    def on_input(name: str, x: torch.Tensor, owner: str) -> None:
        if owner != name:
            if name not in buffers and owner in routed:
                routed[name] = routed[owner]
            else:
                buffers.setdefault(name, buffers[owner])
            return
        if rows is None and x.dim() == 2:  # an expert fed only its routed tokens
            routed.setdefault(name, []).append(x)
            return
        weight = token_weight(work.layer, name) if weighted else None
        if weight is not None:  # [T] for the T = B·L tokens of x
            x = x * weight.sqrt().to(x.dtype).reshape(*x.shape[:-1], 1)
        if rows is None:
            shape, part = (num_samples, *x.shape[1:]), x
            first = filled.get(name, 0)
            filled[name] = first + x.shape[0]
        else:
            flat = x.reshape(-1, x.shape[-1])
            start = filled.get(name, 0)
            filled[name] = start + flat.shape[0]
            lo, hi = torch.searchsorted(rows, torch.tensor([start, start + flat.shape[0]])).tolist()
            shape, part, first = (len(rows), x.shape[-1]), flat[rows[lo:hi] - start], lo
        if name not in buffers:
            buffers[name] = x.new_empty(shape)
        buffers[name][first : first + part.shape[0]] = part
        kept[name] = first + part.shape[0]

    work.run_until_seen(names, on_input, num_samples)
    if rows is not None:  # a routed expert's tokens may not reach every requested row
        truncated = {id(buffers[n]): buffers[n][:count] for n, count in kept.items()}
        buffers = {n: truncated.get(id(b), b) for n, b in buffers.items()}
    for name, parts in routed.items():
        buffers[name] = torch.cat(parts)
    for name in names:  # an expert the router never chose: no inputs
        if name not in buffers:
            width = work.layer.get_submodule(name).in_features
            buffers[name] = work.hidden.new_empty(0, width, device=work.device)
    return buffers


def sequential_groups(layer: torch.nn.Module, family: Family | None = None) -> list[list[str]]:
    """The layer's linear modules in its family's true-sequential order (default: Llama's);
    unknown ones last, one per group."""
    family = family or family_for("llama")
    linears = [n for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)]
    groups = [[n for n in expand_group(group, linears) if n in linears] for group in family.sequential_groups]
    known = {n for group in groups for n in group}
    return [g for g in groups if g] + [[n] for n in linears if n not in known]


LayerProcedure = Callable[[LayerWork], dict[str, tuple[QuantizedWeight, dict]]]


@dataclass
class LayerResult:
    """What calibrating one decoder layer produced."""

    prefix: str  # e.g. "model.layers.3"
    quantized: dict[str, tuple[QuantizedWeight, dict]]  # full linear name -> (weight, stats)
    updated: dict[str, torch.Tensor]  # full parameter name -> full-precision tensor the method changed (CPU)


def calibrate_layerwise(
    model_path,
    tokens: torch.Tensor,
    targets: set[str],
    procedure: LayerProcedure,
    *,
    device: torch.device,
    batch_size: int = 1,
    label: str = "calibrate",
    moe_calibration: str = "all",
    moe_min_tokens: int | None = None,
    then: Callable[["LayerStream", torch.Tensor], LayerResult] | None = None,
    schemes: dict[str, WeightScheme] | None = None,
) -> Iterator[LayerResult]:
    """Quantize every target linear (full checkpoint names) layer by layer with `procedure`, which
    leaves the layer holding its quantized weights; yields each layer's results as soon as it is
    done, so that the caller can write them out rather than hold the whole model's.

    Mixture-of-experts layers: see quant/moe.py for `moe_calibration`; each expert linear's stats
    get `routed_tokens`, the calibration tokens the router sent its expert. `then(stream, hidden)`:
    what runs on the last layer's outputs (the head's GPTQ, quant/head.py), yielded last. `schemes`:
    the target linears quantized onto another scheme than the procedure's (LayerWork.schemes)."""
    stream = LayerStream(model_path, device, moe_calibration)
    family = stream.family
    with torch.inference_mode():
        hidden = stream.embed(tokens)
    with progress_bar() as bar:
        task = bar.add_task(label, total=len(targets), info="")
        for index in range(stream.num_layers):
            prefix = stream.layer_name(index)

            def report(name: str, stats: dict, index=index) -> None:
                loss = stats.get("loss", float("nan"))
                bar.update(task, advance=1, info=f"layer {index + 1}/{stream.num_layers} {name}  loss {loss:.3g}")

            with torch.inference_mode():
                layer = stream.load_layer(index)
                rope, mask = stream.layer_inputs(index, tokens.shape[1])
                local_targets = set(_in_layer(family, prefix, targets).values())
                work = LayerWork(
                    layer,
                    prefix,
                    hidden,
                    rope,
                    batch_size,
                    device,
                    local_targets,
                    report,
                    family=family,
                    attention_mask=mask,
                )
                work.min_tokens = expert_min_tokens(layer, family, local_targets, moe_min_tokens)
                own = _in_layer(family, prefix, schemes or {})
                work.schemes = {local: schemes[name] for name, local in own.items()}
                quantized = procedure(work)
                result = LayerResult(
                    prefix, {family.checkpoint_name(f"{prefix}.{n}"): r for n, r in quantized.items()}, {}
                )
                for name, module in work.updated.items():
                    for param, value in module.named_parameters():
                        key = family.checkpoint_name(f"{prefix}.{name}.{param}")
                        result.updated[key] = value.detach().to("cpu", copy=True)
                for block in calibration_modules(layer):
                    block.routed_tokens.zero_()
                run_layer(prefix, layer, hidden, rope, batch_size, device, attention_mask=mask)
                record_routed_tokens(layer, quantized)
                stream.release_layer(index)
            yield result
            del result  # else this frame keeps the layer's results alive through the next layer
    if then is not None:
        with torch.inference_mode():
            yield then(stream, hidden)


def _in_layer(family: Family, prefix: str, names) -> dict[str, str]:
    """The checkpoint names of `names` inside layer `prefix`, each with its local module name."""
    modules = {name: family.module_name(name) for name in names}
    return {
        name: module.removeprefix(f"{prefix}.") for name, module in modules.items() if module.startswith(f"{prefix}.")
    }
