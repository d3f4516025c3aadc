"""An EAGLE-1 head on disk: what `optkit speculator train` writes and `--speculative eagle:DIR` reads.

The head (Li et al. 2024, EAGLE; the reference code's cnets.py) is one decoder layer of the target's
family fed with x_t = fc(concat(embed(token_{t+1}), feature_t)); its output goes straight to the
target's LM head. It reuses the target's embedding and LM head, which are not stored again.

  feature_t      the target's last hidden state after its final norm (the LM head's input) at position t
  embed(token)   the target's input embedding as its first decoder layer receives it: embed_tokens(token)
                 times the family's embedding multiplier (Gemma's √hidden, rounded to the model's dtype;
                 Granite's embedding_multiplier; 1 elsewhere)
  position       the head's row for (feature_t, token_{t+1}) sits at the target's position t
  the layer      layer 0 of the target's family: its attention (full attention, no sliding window, with the
                 RoPE of the target's layer 0: Gemma 3's local base), its MLP and its norms, but no
                 input_layernorm (fc's output goes straight into attention, as cnets.py's first layer)

A head directory holds data only:
  config.json        {"format": "optkit-eagle", "version": 1, "kind": "eagle1", "model_type": the target's,
                     "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "intermediate_size", "rms_norm_eps", the target config.json's RoPE keys
                     (ROPE_KEYS, those it has, copied as they are), "feature_layers": [-1],
                     "target_sha256": `target_digest` of the model it was trained on}
  model.safetensors  fc.weight [H, 2H], columns [embedding | feature] (cnets.py's
                     torch.cat((inputs_embeds, hidden_states), dim=-1)), and the layer under `layers.0.`
                     with the family's Hugging Face names (layers.0.self_attn.q_proj.weight,
                     layers.0.mlp.gate_proj.weight, layers.0.post_attention_layernorm.weight, ...;
                     never layers.0.input_layernorm.weight). Floating point, finite.

`load_head` refuses, in one line each (OptkitError, exit 2): a config that is not this format, a head for
another target (target_sha256, model_type, hidden_size or RoPE keys differ), a missing or extra tensor, a
wrong shape, a NaN or infinity. Nothing is executed: JSON and safetensors only.

Layering: this package sits between runtime/ (which serves heads) and models/: it may import models/ and
anything below it (modeldir, data, kernels, weights), never runtime/, routing/, server/, pipeline/ or cli/.
"""

import hashlib
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from optkit.artifacts import atomic_output_dir, content_sha256
from optkit.errors import OptkitError, shown
from optkit.json_strict import dumps, read_object
from optkit.manifest import read_manifest
from optkit.modeldir import read_config, weight_files
from optkit.safetensors_stream import write_safetensors

FORMAT, VERSION, KIND = "optkit-eagle", 1, "eagle1"
CONFIG, WEIGHTS = "config.json", "model.safetensors"
ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor", "rope_local_base_freq")
_SIZES = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")
LAYER_PREFIX = "layers.0."


@dataclass(frozen=True)
class EagleHeadConfig:
    model_type: str
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    target_sha256: str
    rope: dict = field(default_factory=dict)  # the target config.json's ROPE_KEYS, as they are there
    feature_layers: tuple[int, ...] = (-1,)
    kind: str = KIND

    def to_json(self) -> dict:
        fields = asdict(self)
        rope = fields.pop("rope")
        return {"format": FORMAT, "version": VERSION, **fields, "feature_layers": list(self.feature_layers), **rope}

    @classmethod
    def from_json(cls, data: dict, where: str) -> "EagleHeadConfig":
        if data.get("format") != FORMAT or data.get("version") != VERSION or data.get("kind") != KIND:
            raise OptkitError(
                f"{where}: not an optkit EAGLE head (format {shown(data.get('format'))}, version "
                f"{shown(data.get('version'))}, kind {shown(data.get('kind'))}; "
                f"expected {FORMAT!r} {VERSION} {KIND!r}): "
                "give a directory written by optkit speculator train"
            )
        for name in _SIZES:
            value = data.get(name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1 << 20:
                raise OptkitError(f"{where}: {name} {shown(value)} is not a positive whole number: re-train the head")
        eps = data.get("rms_norm_eps")
        if isinstance(eps, bool) or not isinstance(eps, int | float) or not (0 < eps < 1):
            raise OptkitError(f"{where}: rms_norm_eps {shown(eps)} is not in (0, 1): re-train the head")
        if data.get("feature_layers") != [-1]:
            raise OptkitError(
                f"{where}: feature_layers {shown(data.get('feature_layers'))}: this optkit serves EAGLE-1 heads, "
                "whose feature is the last layer's ([-1])"
            )
        for name in ("model_type", "target_sha256"):
            if not isinstance(data.get(name), str):
                raise OptkitError(f"{where}: {name} {shown(data.get(name))} is not a string: re-train the head")
        return cls(
            model_type=data["model_type"],
            **{name: data[name] for name in _SIZES},
            rms_norm_eps=float(eps),
            target_sha256=data["target_sha256"],
            rope={key: data[key] for key in ROPE_KEYS if key in data},
        )


@dataclass
class EagleHead:
    config: EagleHeadConfig
    fc_weight: torch.Tensor  # [H, 2H]: columns [embedding | feature]
    layer: dict[str, torch.Tensor]  # the decoder layer's tensors, names without "layers.0."


def target_digest(model_dir: Path) -> str:
    """sha256 over the names and sha256 of the model's safetensors (weight_files): for an optkit
    artifact the digests its optkit.json lists (a release shares its artifact's), else the files' own."""
    model_dir = Path(model_dir)
    listed = (read_manifest(model_dir) or {}).get("files", {})
    digest = hashlib.sha256()
    for file in weight_files(model_dir):
        digest.update(f"{file.name}\0{listed.get(file.name) or content_sha256(file)}\n".encode())
    return digest.hexdigest()


def head_config_for(target_dir: Path, intermediate_size: int | None = None) -> EagleHeadConfig:
    """The config of a head for the model in `target_dir`: its sizes (the MLP's `intermediate_size`
    unless told), its RoPE keys and its digest."""
    from optkit.models.config import ModelConfig

    target_dir = Path(target_dir)
    raw = read_config(target_dir)
    config = ModelConfig.from_hf(raw)
    return EagleHeadConfig(
        model_type=config.model_type,
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        intermediate_size=intermediate_size or config.intermediate_size,
        rms_norm_eps=config.rms_norm_eps,
        target_sha256=target_digest(target_dir),
        rope={key: raw[key] for key in ROPE_KEYS if key in raw},
    )


def save_head(
    out: Path, config: EagleHeadConfig, tensors: Mapping[str, torch.Tensor], *, overwrite: bool = False
) -> None:
    """Write a head directory atomically (a temporary renamed into place): config.json and
    model.safetensors with `tensors` (fc.weight and layers.0.*) as they are."""
    _check_tensors(dict(tensors), None, str(out))
    with atomic_output_dir(Path(out), overwrite=overwrite) as tmp:
        write_safetensors(tmp / WEIGHTS, {name: t.detach().contiguous() for name, t in tensors.items()})
        (tmp / CONFIG).write_text(dumps(config.to_json(), indent=2) + "\n")


LayerShapes = Mapping[str, tuple[int, ...]]  # tensor name under layers.0. -> shape


def load_head(
    head_dir: Path,
    target_dir: Path,
    layer_shapes: LayerShapes | Callable[[EagleHeadConfig], LayerShapes] | None = None,
) -> EagleHead:
    """The head in `head_dir`, checked against the target model in `target_dir` (its digest, family,
    width and RoPE) and, given `layer_shapes` (or a function of the head's config that gives them),
    its layer's tensors: exactly those names, those shapes."""
    head_dir, target_dir = Path(head_dir), Path(target_dir)
    where = f"--speculative eagle:{head_dir}"
    if not (head_dir / CONFIG).is_file() or not (head_dir / WEIGHTS).is_file():
        raise OptkitError(
            f"{where}: no {CONFIG} and {WEIGHTS} there: give a directory written by optkit speculator train"
        )
    config = EagleHeadConfig.from_json(read_object(head_dir / CONFIG, "an EAGLE head's config"), where)
    _check_target(config, target_dir, where)
    tensors = _read_tensors(head_dir / WEIGHTS, where)
    _check_tensors(tensors, config, where)
    layer = {name.removeprefix(LAYER_PREFIX): t for name, t in tensors.items() if name.startswith(LAYER_PREFIX)}
    if callable(layer_shapes):
        layer_shapes = layer_shapes(config)
    if layer_shapes is not None:
        missing = sorted(set(layer_shapes) - set(layer))
        extra = sorted(set(layer) - set(layer_shapes))
        if missing or extra:
            named = [f"lacks {LAYER_PREFIX}{missing[0]}"] if missing else []
            if extra:
                named.append(f"has {LAYER_PREFIX}{extra[0]}, which a {config.model_type} head has no place for")
            raise OptkitError(f"{where}: {WEIGHTS} {' and '.join(named)}: re-train the head for this target")
        for name, shape in layer_shapes.items():
            if tuple(layer[name].shape) != tuple(shape):
                raise OptkitError(
                    f"{where}: {LAYER_PREFIX}{name} is {list(layer[name].shape)}, the head's config makes it "
                    f"{list(shape)}: re-train the head"
                )
    return EagleHead(config, tensors["fc.weight"], layer)


def _check_target(config: EagleHeadConfig, target_dir: Path, where: str) -> None:
    raw = read_config(target_dir)
    digest = target_digest(target_dir)
    if config.target_sha256 != digest:
        raise OptkitError(
            f"{where}: the head was trained for another model (target_sha256 {config.target_sha256[:12]}…, "
            f"{target_dir.name}'s weights are {digest[:12]}…): train one for it with optkit speculator train"
        )
    if config.model_type != raw.get("model_type") or config.hidden_size != raw.get("hidden_size"):
        raise OptkitError(
            f"{where}: a {config.model_type} head of width {config.hidden_size} for a {raw.get('model_type')} "
            f"model of width {raw.get('hidden_size')}: train one for it with optkit speculator train"
        )
    rope = {key: raw[key] for key in ROPE_KEYS if key in raw}
    if config.rope != rope:
        raise OptkitError(
            f"{where}: its RoPE settings {shown(config.rope)} are not the target's {shown(rope)}: re-train the head"
        )


def _read_tensors(file: Path, where: str) -> dict[str, torch.Tensor]:
    try:
        with safe_open(file, framework="pt") as f:
            return {key: f.get_tensor(key) for key in f.keys()}
    except (SafetensorError, OSError) as e:
        raise OptkitError(f"{where}: {file.name} is truncated or corrupt ({e}): re-train or re-copy the head") from e


def _check_tensors(tensors: dict[str, torch.Tensor], config: EagleHeadConfig | None, where: str) -> None:
    fc = tensors.get("fc.weight")
    if fc is None:
        raise OptkitError(f"{where}: {WEIGHTS} lacks fc.weight: re-train the head")
    hidden = config.hidden_size if config is not None else fc.shape[0]
    if tuple(fc.shape) != (hidden, 2 * hidden):
        raise OptkitError(f"{where}: fc.weight is {list(fc.shape)}, expected {[hidden, 2 * hidden]}: re-train the head")
    for name, tensor in sorted(tensors.items()):
        if name != "fc.weight" and not name.startswith(LAYER_PREFIX):
            raise OptkitError(f"{where}: {WEIGHTS} has {name}: a head holds fc.weight and {LAYER_PREFIX}* only")
        if name == LAYER_PREFIX + "input_layernorm.weight":
            raise OptkitError(f"{where}: {name}: the head's layer has no input_layernorm (fc feeds attention)")
        if not tensor.is_floating_point():
            raise OptkitError(f"{where}: {name} is {tensor.dtype}: a head's tensors are floating point")
        if tensor.numel() and not math.isfinite(float(tensor.float().abs().max())):
            raise OptkitError(f"{where}: {name} holds NaN or infinite values: re-train the head")
