"""Per-layer sensitivity: how much of an artifact's KL divergence each quantized linear causes.

The exact answer for layer l swaps its quantized weight Ŵ_l back to the base's W_l, everything else
left quantized, and measures the drop of the mean KLD: one forward pass per layer. The estimate
costs one backward pass for all layers. With ΔW = Ŵ − W (all layers) and g_l = ∂KLD/∂W_l taken at
the artifact's weights, a first-order Taylor step from Ŵ towards W_l gives

  drop_l ≈ ⟨g_l, Ŵ_l − W_l⟩                                  (to full precision)

Since KLD(W + ΔW) ≈ ½ ΔWᵀ F ΔW (F: the Fisher matrix at the base, where the KLD and its gradient
vanish), g ≈ F ΔW, so ⟨g_l, ΔW_l⟩ = ΔW_lᵀ F_ll ΔW_l + Σ_k≠l ΔW_lᵀ F_lk ΔW_k: the layer's own
quadratic term plus its interaction with the other layers' errors. The exact drop is that minus
½ ΔW_lᵀ F_ll ΔW_l, so the raw score overestimates; a few exact swaps of the top layers give the
scale that turns the scores into nats (`scale`, least squares through the origin).

A move to another quantized rung r (quant/ladder.py: 8 bits, a finer group) leaves the error
e_r = Q_r(W_l) − W_l. The same first-order step, ⟨g_l, Ŵ_l − Q_r(W_l)⟩, cannot price it: e_r is a
fresh rounding error, nearly orthogonal to g_l, so every rung would look as good as full precision.
What a rung keeps is its own quadratic term, which scales with its error in the layer's metric.
With F_ll ≈ (the input's second moments H = E[x xᵀ]) ⊗ (something on the outputs) and H taken
diagonal, that term is ∝ E(e) = Σ_ij e_ij² H_jj, so

  drop_l(r) ≈ drop_l · (1 − E(e_r) / E(Ŵ_l − W_l))

H_jj is summed over the attribution windows in the same forward pass as the gradient.

Layers are named as the checkpoint and the manifest name them. The artifact's model names its
modules as transformers does (Mixtral's `block_sparse_moe` is `mlp`: `Family.module_name`), and
gives a mixture-of-experts block's experts separate linears (quant/moe.py), so each expert's
w1/w2/w3 is a layer of its own; the base's weights come from its checkpoint as stored, which is also
what repair writes for a layer in full precision (transformers fuses a base's experts into 3D
parameters).
"""

from dataclasses import dataclass, field
from pathlib import Path

import torch

from optkit.data.eval_sets import load_text_set
from optkit.data.holdout import sampled_starts, uncovered_windows
from optkit.data.packing import tokenize_stream
from optkit.errors import OptkitError
from optkit.families import family_for
from optkit.manifest import read_manifest
from optkit.modeldir import TensorReader, load_tokenizer, read_config, resolve_model_dir
from optkit.progress import progress_bar
from optkit.quant.formats import reader_for
from optkit.quant.formats.gguf_read import is_gguf, write_model_dir
from optkit.quant.formats.gguf_read import read_config as gguf_config
from optkit.quant.formats.load import load_model
from optkit.quant.head import base_linear_weight
from optkit.quant.ladder import Rung, layer_bytes
from optkit.quant.methods.rtn.math import rtn_quantize
from optkit.quant.mixed_artifact import artifact_scheme, layer_rungs


@dataclass
class LayerSensitivity:
    name: str
    first_order: float  # ⟨g, Ŵ − W⟩, raw
    estimate: float  # scale · first_order: estimated KLD drop (nats) with this layer in full precision
    estimate_8bit: float | None = None  # the same with this layer at 8 bits
    moves: dict[str, float] = field(default_factory=dict)  # rung label -> estimated drop on that rung
    exact: float | None = None  # measured drop, when this layer was swapped

    def to_json(self, kld: float) -> dict:
        return {**self.__dict__, "share": self.estimate / kld if kld > 0 else 0.0}


@dataclass
class Attribution:
    kld: float  # the artifact's mean KLD on the attribution windows
    source: str  # where the windows come from
    tokens: int
    scale: float
    layers: list[LayerSensitivity] = field(default_factory=list)  # most damaging first

    @property
    def spearman(self) -> float | None:
        """Rank correlation of the estimate with the exact swaps, when every layer was swapped."""
        if len(self.layers) < 2 or any(layer.exact is None for layer in self.layers):
            return None
        return spearman([x.first_order for x in self.layers], [x.exact for x in self.layers])

    def to_json(self) -> dict:
        return {
            "kld": self.kld,
            "source": self.source,
            "tokens": self.tokens,
            "scale": self.scale,
            "spearman": self.spearman,
            "exact_swaps": sum(x.exact is not None for x in self.layers),
            "layers": [x.to_json(self.kld) for x in self.layers],
        }


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""

    def ranks(values: list[float]) -> torch.Tensor:
        x = torch.tensor(values, dtype=torch.float64)
        order = x.argsort()
        r = torch.empty_like(x)
        r[order] = torch.arange(len(values), dtype=torch.float64)
        for value in x.unique():  # ties share their mean rank
            tied = x == value
            r[tied] = r[tied].mean()
        return r

    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return (ra @ rb / (ra.norm() * rb.norm()).clamp(min=1e-12)).item()


def attribution_windows(base_dir: Path, manifest: dict, seq_len: int, count: int) -> tuple[torch.Tensor, str]:
    """Windows of the artifact's calibration set that calibration did not read (the whole `calib`
    set for a data-free method): data the gate's eval set and the calibration never saw."""
    calibration = manifest.get("calibration") or {}
    name = calibration.get("name") or "calib"
    texts = load_text_set(name, flag="--calib").texts
    tokenizer = load_tokenizer(base_dir)
    stream = torch.cat([tokenize_stream(tokenizer, [text]) for text in texts])
    num_samples, taken_len = calibration.get("num_samples") or 0, calibration.get("seq_len") or 0
    seed = (manifest.get("options") or {}).get("calibration", {}).get("seed", 0)
    taken = sampled_starts(stream.numel(), taken_len, num_samples, seed) if num_samples else torch.zeros(0)
    windows = uncovered_windows(stream, taken.long(), taken_len, seq_len, count, name=name)
    return windows, f"{name} (windows calibration did not read)"


def _kld_sum(base_logp: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Σ over positions of KL(P_base ‖ P): base_logp [B, T-1, V], logits [B, T, V]."""
    log_q = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return (base_logp.exp() * (base_logp - log_q)).sum()


def attribute(
    artifact: str | Path,
    baseline: str | Path,
    *,
    windows: int = 8,
    seq_len: int = 256,
    exact: int = 3,
    batch_size: int = 4,
    rungs: list[Rung] | None = None,
) -> Attribution:
    """Rank the artifact's quantized linears by the KLD each causes (module doc). `exact`: how many
    of the top layers are swapped exactly to set the scale (-1: every layer, for benchmarks).
    `rungs`: the quantized rungs to price a move to, for each layer whose own rung takes fewer
    bytes (default: 8 bits)."""
    one_file = is_gguf(artifact)  # a .gguf optkit wrote: its manifest and weights as llama.cpp holds them
    artifact_dir, base_dir = Path(artifact) if one_file else resolve_model_dir(artifact), resolve_model_dir(baseline)
    manifest, config = _gguf_manifest(artifact_dir) if one_file else _weight_only_manifest(artifact_dir)
    tokens, source = attribution_windows(base_dir, manifest, seq_len, windows)
    scheme = artifact_scheme(manifest)
    on = layer_rungs(manifest)
    shapes = {layer["name"]: layer["shape"] for layer in manifest["layers"]}
    names = [name for name, rung in on.items() if not rung.full]
    eight = Rung(8).resolve(scheme)
    targets = [r.resolve(scheme) for r in (rungs if rungs is not None else [eight]) if not r.full]

    base_model, model = load_model(base_dir), _gguf_model(artifact_dir) if one_file else load_model(artifact_dir)
    model.requires_grad_(False)
    family = family_for(config.get("model_type"))  # the manifest names checkpoint keys
    modules = {name: model.get_submodule(family.module_name(name)) for name in names}
    base_weights = TensorReader(base_dir)

    def base_weight(name: str) -> torch.Tensor:  # a tied head's: the embedding
        return base_linear_weight(base_weights, name).float()

    kld = _WindowKLD(base_model, tokens, batch_size)
    total, second_moments = _backward_pass(model, modules, kld)
    linears = {name: module.weight for name, module in modules.items()}
    with torch.no_grad():
        layers = []
        for name, weight in linears.items():
            pricing = (shapes[name], on[name], scheme, targets, eight)
            layers.append(_layer_sensitivity(name, weight, base_weight(name), second_moments[name], *pricing))
        layers.sort(key=lambda x: x.first_order, reverse=True)
        swaps = layers if exact < 0 else layers[:exact]
        with progress_bar() as bar:  # each layer's exact change: its float weights restored, then put back
            task = bar.add_task("exact swaps", total=len(swaps), info="")
            for layer in swaps:
                weight = linears[layer.name]
                saved = weight.detach().clone()
                weight.copy_(base_weight(layer.name))
                layer.exact = total - kld.mean(model)
                weight.copy_(saved)
                bar.update(task, advance=1, info=layer.name)
    return Attribution(total, source, kld.count, _rescale(layers, swaps), layers)


def _weight_only_manifest(artifact_dir: Path) -> tuple[dict, dict]:
    """(manifest, config.json) of an optkit artifact with per-layer records whose activations stay
    in float; a user error otherwise."""
    manifest = read_manifest(artifact_dir)
    if manifest is None or not manifest.get("layers"):
        raise OptkitError(f"{artifact_dir} has no optkit.json with per-layer records: attribute an optkit artifact")
    config = read_config(artifact_dir)
    quant_config = config.get("quantization_config") or {}
    if reader_for(quant_config, str(artifact_dir)).is_w8a8(quant_config):
        raise OptkitError(f"{artifact_dir} quantizes activations too (W8A8): attribution ranks weight-only artifacts")
    return manifest, config


def _gguf_manifest(path: Path) -> tuple[dict, dict]:
    """(manifest, config) of a .gguf optkit wrote, with per-layer records (each with its `gguf_type`)."""
    from optkit.quant.mixed_gguf import gguf_manifest

    manifest = gguf_manifest(path)
    if manifest is None or not manifest.get("layers"):
        raise OptkitError(f"{path} has no optkit manifest with per-layer records: attribute a file optkit wrote")
    return manifest, gguf_config(path)


def _gguf_model(path: Path) -> torch.nn.Module:
    """The .gguf's weights, dequantized as ggml does (gguf_read.py), as a transformers model."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="optkit-attribution-") as tmp:
        return load_model(write_model_dir(path, Path(tmp) / "model"))


class _WindowKLD:
    """Mean KL(P_base ‖ P) over the windows, in batches: the base model's log-probabilities once."""

    def __init__(self, base_model: torch.nn.Module, tokens: torch.Tensor, batch_size: int):
        self.batches = [tokens[i : i + batch_size] for i in range(0, len(tokens), batch_size)]
        self.count = sum(b.shape[0] * (b.shape[1] - 1) for b in self.batches)
        with torch.no_grad():
            self.base_logp = [torch.log_softmax(base_model(b).logits[:, :-1].float(), dim=-1) for b in self.batches]

    def mean(self, model: torch.nn.Module) -> float:
        with torch.no_grad():
            pairs = zip(self.batches, self.base_logp, strict=True)
            return sum(_kld_sum(r, model(b).logits).item() for b, r in pairs) / self.count


def _backward_pass(
    model: torch.nn.Module, modules: dict[str, torch.nn.Module], kld: _WindowKLD
) -> tuple[float, dict[str, torch.Tensor]]:
    """One backward pass for every layer: the mean KLD, each layer's weight gradient (in .grad) and
    its inputs' second moments H_jj = Σ x_j² (float64)."""
    for module in modules.values():
        module.weight.requires_grad_(True)
    second_moments = {name: torch.zeros(m.weight.shape[1], dtype=torch.float64) for name, m in modules.items()}

    def accumulate(name: str):
        def hook(module, inputs, output):  # inputs[0]: [B, T, in] -> H_jj += Σ x_j²
            x = inputs[0].detach()
            second_moments[name] += x.double().pow(2).reshape(-1, x.shape[-1]).sum(0)

        return hook

    hooks = [module.register_forward_hook(accumulate(name)) for name, module in modules.items()]
    total = 0.0
    for batch, reference in zip(kld.batches, kld.base_logp, strict=True):
        loss = _kld_sum(reference, model(batch).logits) / kld.count
        loss.backward()
        total += loss.item()
    for hook in hooks:
        hook.remove()
    return total, second_moments


def _layer_sensitivity(
    name: str,
    weight: torch.Tensor,
    original: torch.Tensor,
    h: torch.Tensor,
    shape: list[int],
    rung: Rung,
    scheme,
    targets: list[Rung],
    eight: Rung,
) -> LayerSensitivity:
    """The first-order KLD change of restoring the layer, g · (Ŵ − W), and of moving it to each
    larger rung of `targets`: the share of its error E(Ŵ − W) = Σ (Ŵ − W)² H the move removes."""
    first_order = (weight.grad * (weight - original)).sum().item()
    moves = {}
    error = ((weight.double() - original.double()).pow(2) @ h).sum().item()  # E(Ŵ − W)
    if getattr(scheme, "type", "int") == "int" and error > 0:
        current = layer_bytes(shape, rung, scheme)
        for target_rung in targets:
            if target_rung.fits(shape[1]) and layer_bytes(shape, target_rung, scheme) > current:
                target = rtn_quantize(original, target_rung.scheme(scheme)).dequantize()
                kept = ((target.double() - original.double()).pow(2) @ h).sum().item() / error
                moves[target_rung.label] = first_order * (1 - kept)
    return LayerSensitivity(name, first_order, first_order, moves.get(eight.label), moves)


def _rescale(layers: list[LayerSensitivity], swaps: list[LayerSensitivity]) -> float:
    """The least-squares scale from first-order to exact changes over the swapped layers, applied
    to every layer's estimates."""
    fo = torch.tensor([x.first_order for x in swaps], dtype=torch.float64)
    ex = torch.tensor([x.exact for x in swaps], dtype=torch.float64)
    scale = (fo @ ex / (fo @ fo)).item() if swaps and (fo @ fo) > 0 else 1.0
    for layer in layers:
        layer.estimate = scale * layer.first_order
        if layer.estimate_8bit is not None:
            layer.estimate_8bit *= scale
        layer.moves = {label: scale * value for label, value in layer.moves.items()}
    return scale
