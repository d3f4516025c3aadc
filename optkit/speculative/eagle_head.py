"""An EAGLE head on disk (EAGLE-1 or EAGLE-3): what `optkit speculator train` writes and
`--speculative eagle:DIR` reads. config.json's "kind" says which.

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

An EAGLE-3 head (Li et al. 2025, EAGLE-3; vLLM's llama_eagle3.py, whose tensor names it keeps) is one
Llama decoder layer whatever the target's family (vLLM serves every family's EAGLE-3 heads so), fed
with the target's residual streams entering three of its layers, fused:

  g_t            concat(a_t, b_t, c_t) [3H]: the residual streams entering the target's layers
                 feature_layers = [low, middle, high] at position t (EAGLE3_FEATURE_LAYERS)
  row t          residual = fc(g_t) for a row of real features, or the head's own output h at t-1
                 (its pre-norm hidden, vLLM's hidden_prenorm) for a drafted row; then
                 x = concat(input_layernorm(embed(token_{t+1})), hidden_norm(residual))  [2H]
                 residual += self_attn(x);  residual += mlp(post_attention_layernorm(residual))
                 h_t = residual;  logits_{t+2} = lm_head(norm(h_t)) over the draft vocabulary
  draft vocab    draft_vocab_size tokens of the target's vocabulary (the most frequent in the
                 training text); draft id d is target id d + d2t[d] (vLLM's draft_id_to_target_id)

  config.json        as above with "kind": "eagle3", "feature_layers": [low, middle, high] (each in
                     0..num_hidden_layers-1), "draft_vocab_size": N
  model.safetensors  fc.weight [H, 3H]; layers.0.input_layernorm.weight, layers.0.hidden_norm.weight,
                     layers.0.self_attn.{q,k,v}_proj.weight [*, 2H] (columns [embedding | hidden]),
                     layers.0.self_attn.o_proj.weight, layers.0.post_attention_layernorm.weight,
                     layers.0.mlp.{gate,up,down}_proj.weight; norm.weight [H]; lm_head.weight [N, H];
                     d2t int64 [N]. The target's embedding is reused, its LM head is not.

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
KIND3 = "eagle3"
KINDS = (KIND, KIND3)
EAGLE3_OUTPUT = ("norm.weight", "lm_head.weight", "d2t")  # an EAGLE-3 head's tensors beside fc and the layer
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
    draft_vocab_size: int | None = None  # EAGLE-3's reduced vocabulary; EAGLE-1 has the target's

    def to_json(self) -> dict:
        fields = asdict(self)
        rope = fields.pop("rope")
        if fields["draft_vocab_size"] is None:  # EAGLE-1's config.json, as it has always been written
            del fields["draft_vocab_size"]
        return {"format": FORMAT, "version": VERSION, **fields, "feature_layers": list(self.feature_layers), **rope}

    @classmethod
    def from_json(cls, data: dict, where: str) -> "EagleHeadConfig":
        if data.get("format") != FORMAT or data.get("version") != VERSION or data.get("kind") not in KINDS:
            raise OptkitError(
                f"{where}: not an optkit EAGLE head (format {shown(data.get('format'))}, version "
                f"{shown(data.get('version'))}, kind {shown(data.get('kind'))}; "
                f"expected {FORMAT!r} {VERSION}, kind {' or '.join(map(repr, KINDS))}): "
                "give a directory written by optkit speculator train"
            )
        kind = data["kind"]
        for name in _SIZES:
            value = data.get(name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1 << 20:
                raise OptkitError(f"{where}: {name} {shown(value)} is not a positive whole number: re-train the head")
        eps = data.get("rms_norm_eps")
        if isinstance(eps, bool) or not isinstance(eps, int | float) or not (0 < eps < 1):
            raise OptkitError(f"{where}: rms_norm_eps {shown(eps)} is not in (0, 1): re-train the head")
        layers, draft_vocab_size = data.get("feature_layers"), data.get("draft_vocab_size")
        if kind == KIND and layers != [-1]:
            raise OptkitError(
                f"{where}: feature_layers {shown(layers)}: an EAGLE-1 head's feature is the last layer's ([-1])"
            )
        if kind == KIND3:
            if not _whole_numbers(layers, 0) or len(layers) != 3:
                raise OptkitError(
                    f"{where}: feature_layers {shown(layers)}: an EAGLE-3 head reads three layers "
                    "(indices from 0): re-train the head"
                )
            if not _whole_numbers([draft_vocab_size], 1):
                raise OptkitError(
                    f"{where}: draft_vocab_size {shown(draft_vocab_size)} is not a positive whole number: "
                    "re-train the head"
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
            feature_layers=tuple(layers),
            kind=kind,
            draft_vocab_size=draft_vocab_size if kind == KIND3 else None,
        )


def _whole_numbers(values, least: int) -> bool:
    return isinstance(values, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and least <= v <= 1 << 24 for v in values
    )


@dataclass
class EagleHead:
    config: EagleHeadConfig
    fc_weight: torch.Tensor  # EAGLE-1 [H, 2H]: columns [embedding | feature]; EAGLE-3 [H, 3H]
    layer: dict[str, torch.Tensor]  # the decoder layer's tensors, names without "layers.0."
    output: dict[str, torch.Tensor] = field(default_factory=dict)  # EAGLE-3: EAGLE3_OUTPUT's tensors


def eagle3_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """The low, middle and high layers whose input an EAGLE-3 head reads: vLLM's default (2, L//2,
    L-3) where those are distinct (L >= 7); for a shallower target the first layer past the
    embedding, the middle one and the last one (L=4: 1, 2, 3), so that the three stay apart as far
    as L allows (never the embedding itself unless L is 1)."""
    if num_layers >= 7:
        return 2, num_layers // 2, num_layers - 3
    low = min(1, num_layers - 1)
    return low, max(low, num_layers // 2), num_layers - 1


def target_digest(model_dir: Path) -> str:
    """sha256 over the names and sha256 of the model's safetensors (weight_files): for an optkit
    artifact the digests its optkit.json lists (a release shares its artifact's), else the files' own."""
    model_dir = Path(model_dir)
    listed = (read_manifest(model_dir) or {}).get("files", {})
    digest = hashlib.sha256()
    for file in weight_files(model_dir):
        digest.update(f"{file.name}\0{listed.get(file.name) or content_sha256(file)}\n".encode())
    return digest.hexdigest()


def head_config_for(
    target_dir: Path,
    intermediate_size: int | None = None,
    *,
    kind: str = KIND,
    draft_vocab_size: int | None = None,
    feature_layers: tuple[int, ...] | None = None,
) -> EagleHeadConfig:
    """The config of a head of `kind` for the model in `target_dir`: its sizes (the MLP's
    `intermediate_size` unless told), its RoPE keys and its digest; EAGLE-3: its `draft_vocab_size`
    and `feature_layers` (eagle3_feature_layers unless told)."""
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
        **(
            {}
            if kind == KIND
            else {
                "kind": kind,
                "draft_vocab_size": draft_vocab_size,
                "feature_layers": tuple(feature_layers or eagle3_feature_layers(config.num_hidden_layers)),
            }
        ),
    )


def save_head(
    out: Path, config: EagleHeadConfig, tensors: Mapping[str, torch.Tensor], *, overwrite: bool = False
) -> None:
    """Write a head directory atomically (a temporary renamed into place): config.json and
    model.safetensors with `tensors` (fc.weight and layers.0.*) as they are."""
    _check_tensors(dict(tensors), config, str(out))
    with atomic_output_dir(Path(out), overwrite=overwrite) as tmp:
        write_safetensors(tmp / WEIGHTS, {name: t.detach().contiguous() for name, t in tensors.items()})
        (tmp / CONFIG).write_text(dumps(config.to_json(), indent=2) + "\n")


def read_head_config(head_dir: Path) -> EagleHeadConfig:
    """The config of the head in `head_dir` (checked as data; `load_head` checks it against a target)."""
    head_dir = Path(head_dir)
    where = f"--speculative eagle:{head_dir}"
    if not (head_dir / CONFIG).is_file() or not (head_dir / WEIGHTS).is_file():
        raise OptkitError(
            f"{where}: no {CONFIG} and {WEIGHTS} there: give a directory written by optkit speculator train"
        )
    return EagleHeadConfig.from_json(read_object(head_dir / CONFIG, "an EAGLE head's config"), where)


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
    config = read_head_config(head_dir)
    vocab_size = _check_target(config, target_dir, where)
    tensors = _read_tensors(head_dir / WEIGHTS, where)
    _check_tensors(tensors, config, where)
    if config.kind == KIND3:
        _check_draft_vocab(tensors["d2t"], vocab_size, where)
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
    output = {name: tensors[name] for name in EAGLE3_OUTPUT if name in tensors}
    return EagleHead(config, tensors["fc.weight"], layer, output)


def _check_target(config: EagleHeadConfig, target_dir: Path, where: str) -> int:
    """Refuses a head for another target; returns the target's vocabulary size."""
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
    num_layers, vocab_size = raw.get("num_hidden_layers"), raw.get("vocab_size")
    if config.kind == KIND3:
        if not isinstance(num_layers, int) or max(config.feature_layers) >= num_layers:
            raise OptkitError(
                f"{where}: feature_layers {list(config.feature_layers)} reach past the target's {num_layers} "
                "layers: train one for it with optkit speculator train"
            )
        if not isinstance(vocab_size, int) or config.draft_vocab_size > vocab_size:
            raise OptkitError(
                f"{where}: draft_vocab_size {config.draft_vocab_size} is more than the target's vocabulary "
                f"({vocab_size}): re-train the head"
            )
    return vocab_size


def _check_draft_vocab(d2t: torch.Tensor, vocab_size: int, where: str) -> None:
    """d + d2t[d] must name distinct tokens of the target's vocabulary."""
    ids = torch.arange(len(d2t)) + d2t
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size or len(ids.unique()) != len(ids):
        raise OptkitError(
            f"{where}: d2t maps the draft vocabulary outside the target's {vocab_size} tokens or onto one "
            "token twice: re-train the head"
        )


def _read_tensors(file: Path, where: str) -> dict[str, torch.Tensor]:
    try:
        with safe_open(file, framework="pt") as f:
            return {key: f.get_tensor(key) for key in f.keys()}
    except (SafetensorError, OSError) as e:
        raise OptkitError(f"{where}: {file.name} is truncated or corrupt ({e}): re-train or re-copy the head") from e


def _check_tensors(tensors: dict[str, torch.Tensor], config: EagleHeadConfig, where: str) -> None:
    fc = tensors.get("fc.weight")
    if fc is None:
        raise OptkitError(f"{where}: {WEIGHTS} lacks fc.weight: re-train the head")
    hidden, eagle3 = config.hidden_size, config.kind == KIND3
    expected = [hidden, (3 if eagle3 else 2) * hidden]
    if list(fc.shape) != expected:
        raise OptkitError(f"{where}: fc.weight is {list(fc.shape)}, expected {expected}: re-train the head")
    outputs = {}
    if eagle3:
        vocab = config.draft_vocab_size
        outputs = {"norm.weight": [hidden], "lm_head.weight": [vocab, hidden], "d2t": [vocab]}
        for name, shape in outputs.items():
            if name not in tensors:
                raise OptkitError(f"{where}: {WEIGHTS} lacks {name}: re-train the head")
            if list(tensors[name].shape) != shape:
                raise OptkitError(
                    f"{where}: {name} is {list(tensors[name].shape)}, expected {shape}: re-train the head"
                )
        if tensors["d2t"].dtype != torch.int64:
            raise OptkitError(f"{where}: d2t is {tensors['d2t'].dtype}, not int64: re-train the head")
    for name, tensor in sorted(tensors.items()):
        if name == "d2t" and eagle3:
            continue
        if name != "fc.weight" and name not in outputs and not name.startswith(LAYER_PREFIX):
            held = f"fc.weight, {', '.join(EAGLE3_OUTPUT)}" if eagle3 else "fc.weight"
            raise OptkitError(f"{where}: {WEIGHTS} has {name}: a head holds {held} and {LAYER_PREFIX}* only")
        if name == LAYER_PREFIX + "input_layernorm.weight" and not eagle3:
            raise OptkitError(f"{where}: {name}: the head's layer has no input_layernorm (fc feeds attention)")
        if not tensor.is_floating_point():
            raise OptkitError(f"{where}: {name} is {tensor.dtype}: a head's tensors are floating point")
        if tensor.numel() and not math.isfinite(float(tensor.float().abs().max())):
            raise OptkitError(f"{where}: {name} holds NaN or infinite values: re-train the head")
