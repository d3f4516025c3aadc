"""The bitsandbytes 4-bit (NF4) checkpoint format, as transformers (with `bitsandbytes` installed) and
vLLM load pre-quantized QLoRA-style models.

Per quantized linear `P`, the safetensors file holds (bitsandbytes' `Params4bit` state dict,
`QuantState.as_dict(packed=True)` in bitsandbytes/functional.py):
  P.weight                                uint8 [out·in/2, 1]  codes of the row-major flattened weight,
                                          two per byte, the even element in the high nibble
  P.weight.absmax                         float32 [out·in/block]  per block (uint8 codes with double quant)
  P.weight.quant_map                      float32 [16]  the NF4 values
  P.weight.nested_absmax                  float32 [ceil(n/256)]   double quant: absmax of each 256 absmax
  P.weight.nested_quant_map               float32 [256]           double quant: the dynamic map
  P.weight.quant_state.bitsandbytes__nf4  uint8 [*]  UTF-8 JSON of {quant_type, blocksize, dtype, shape
                                          (and nested_blocksize, nested_dtype, nested_offset)}
and config.json carries `quantization_config` with quant_method "bitsandbytes", load_in_4bit true,
bnb_4bit_quant_type "nf4" (transformers' BitsAndBytesConfig.to_dict()).
The blocks of 64 run over the flattened weight; optkit requires in_features to be a multiple of the
block, so they are exactly the per-row groups of a WeightScheme with group_size = block.
"""

import json
import math

import torch

from optkit.errors import OptkitError
from optkit.quant.formats.common import read_checked
from optkit.quant.formats.defaults import check_model as check_model
from optkit.quant.formats.defaults import constrain as constrain
from optkit.quant.formats.defaults import file_config as file_config
from optkit.quant.formats.defaults import gptq_defaults as gptq_defaults
from optkit.quant.formats.defaults import is_w8a8 as is_w8a8
from optkit.quant.formats.defaults import quant_method_is
from optkit.quant.formats.defaults import w8a8_modules as w8a8_modules
from optkit.quant.formats.defaults import write_file as write_file
from optkit.quant.formats.kind import ArtifactKind
from optkit.quant.methods.nf4.math import NESTED_BLOCKSIZE, double_dequantize, double_quantize
from optkit.weights.codebooks import dynamic_code, nf4_code
from optkit.weights.quantized import QuantizedWeight
from optkit.weights.schemes import WeightScheme

NAME = "bitsandbytes"
detect = quant_method_is(NAME)
# CheckpointFormat's defaults, imported above (formats/defaults.py):
# check_model, constrain, file_config, gptq_defaults, is_w8a8, w8a8_modules, write_file
QUANT_STATE = "weight.quant_state.bitsandbytes__nf4"
MARKER = "weight.quant_map"  # the suffix that marks a quantized linear
SUFFIXES = (
    "weight",
    "weight.absmax",
    "weight.quant_map",
    "weight.nested_absmax",
    "weight.nested_quant_map",
    QUANT_STATE,
)
BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)  # what bitsandbytes' quantize_4bit accepts
MAX_STATE_BYTES = 4096  # a quant state is a few keys of JSON
MAX_DIM = 2**24  # a side of a quantized weight (an output head's: the vocabulary)
DTYPE = "float32"  # the dtype bitsandbytes dequantizes to (and computes in): exact, like optkit's reference
SUFFIX = None  # an artifact directory
runtime = None  # optkit's runtime
LOADERS = {"optkit": (), "transformers": ("bitsandbytes",), "gptqmodel": ()}  # and vLLM (`vllm_loader`)


def check(
    scheme: WeightScheme, act_order: bool | str, layers: list[tuple[str, int, int]], activations: str | None = None
) -> None:
    if scheme.type != "nf4" or activations is not None:
        raise OptkitError("--format bitsandbytes stores NF4 weights only: use --method nf4")
    if scheme.group_size not in BLOCKSIZES:
        raise OptkitError(f"bitsandbytes blocks hold one of {BLOCKSIZES} values: use --group-size 64")
    for name, in_features, _ in layers:
        if in_features % scheme.group_size:
            raise OptkitError(f"{name}: {in_features} input features are not whole blocks of {scheme.group_size}")


def quantization_config(
    scheme: WeightScheme, act_order: bool | str, ignore: list[str], activations: str | None = None
) -> dict:
    """transformers' `BitsAndBytesConfig(load_in_4bit=True, ...).to_dict()`, written out here so the
    format needs no transformers import; `llm_int8_skip_modules` lists the full-precision layers."""
    return {
        "quant_method": NAME,
        "_load_in_8bit": False,
        "_load_in_4bit": True,
        "llm_int8_threshold": 6.0,
        "llm_int8_skip_modules": ignore,
        "llm_int8_enable_fp32_cpu_offload": False,
        "llm_int8_has_fp16_weight": False,
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": scheme.double_quant,
        "bnb_4bit_compute_dtype": DTYPE,
        "bnb_4bit_quant_storage": "uint8",
        "load_in_4bit": True,
        "load_in_8bit": False,
    }


def _pack_json(data: dict) -> torch.Tensor:
    return torch.tensor(list(json.dumps(data).encode("utf-8")), dtype=torch.uint8)


def _unpack_json(tensor: torch.Tensor, where: str) -> dict:
    if tensor.numel() > MAX_STATE_BYTES:
        raise OptkitError(f"{where}: the bitsandbytes quant state is {tensor.numel()} bytes, not a few keys of JSON")
    try:
        state = json.loads(bytes(tensor.to(torch.uint8).reshape(-1).tolist()).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        reason = e.msg if isinstance(e, json.JSONDecodeError) else type(e).__name__
        raise OptkitError(
            f"{where}: the bitsandbytes quant state is not JSON ({reason}): re-create the artifact"
        ) from e
    if not isinstance(state, dict):
        raise OptkitError(f"{where}: the bitsandbytes quant state is not a JSON object: re-create the artifact")
    return state


def _checked_state(state: dict, tensors: dict[str, torch.Tensor], prefix: str) -> tuple[int, int, int]:
    """(out, in, block) of a quant state that the layer's tensors agree with; an OptkitError otherwise."""
    where = f"{prefix}: the bitsandbytes quant state"
    shape, block = state.get("shape"), state.get("blocksize")
    if not (isinstance(shape, list) and len(shape) == 2 and all(_whole(d) and 1 <= d <= MAX_DIM for d in shape)):
        raise OptkitError(f"{where} has shape {_shown(shape)}: [out, in] of whole numbers from 1 to {MAX_DIM} expected")
    if not _whole(block) or block not in BLOCKSIZES:
        raise OptkitError(f"{where} has blocksize {_shown(block)}: bitsandbytes blocks hold one of {BLOCKSIZES}")
    out, inp = shape
    packed = tensors[f"{prefix}.weight"]
    if packed.dtype != torch.uint8 or packed.numel() != -(-out * inp // 2):
        raise OptkitError(
            f"{where} says {out}×{inp}, but {prefix}.weight holds {packed.numel()} {packed.dtype} values "
            f"(the codes of {out}×{inp}, two a byte, are {-(-out * inp // 2)} uint8): re-create the artifact"
        )
    if inp % block:
        raise OptkitError(f"{prefix}: blocks of {block} straddle rows of {inp}: optkit reads whole-row blocks")
    absmax, blocks = tensors[f"{prefix}.weight.absmax"], out * inp // block
    if absmax.numel() != blocks:
        raise OptkitError(f"{prefix}.weight.absmax holds {absmax.numel()} values for {blocks} blocks: re-create it")
    if "nested_offset" in state:
        offset, nested = state["nested_offset"], tensors[f"{prefix}.weight.nested_absmax"]
        if isinstance(offset, bool) or not isinstance(offset, int | float) or not math.isfinite(offset):
            raise OptkitError(f"{where} has nested_offset {_shown(offset)}: a finite number expected")
        if absmax.dtype != torch.uint8 or nested.numel() != -(-blocks // NESTED_BLOCKSIZE):
            raise OptkitError(
                f"{prefix}.weight.nested_absmax holds {nested.numel()} values for {blocks} uint8 absmax codes "
                f"in blocks of {NESTED_BLOCKSIZE}: re-create the artifact"
            )
    return out, inp, block


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"a {type(value).__name__}"


def compress(prefix: str, qw: QuantizedWeight, activations: str | None = None) -> dict[str, torch.Tensor]:
    """The tensors of one NF4 linear in bitsandbytes' layout (double quantizing the absmax values
    when the scheme says so)."""
    out, inp = qw.q.shape
    codes = qw.q.to(torch.uint8).reshape(-1)  # row-major flattening: bitsandbytes' block order
    packed = ((codes[0::2] << 4) | codes[1::2]).unsqueeze(1)
    state = {"quant_type": "nf4", "blocksize": qw.scheme.group_size, "dtype": DTYPE, "shape": [out, inp]}
    tensors = {f"{prefix}.weight": packed, f"{prefix}.weight.quant_map": nf4_code().clone()}
    absmax = qw.scale.float().reshape(-1)
    if qw.scheme.double_quant:
        absmax_codes, nested, offset = double_quantize(absmax)
        tensors[f"{prefix}.weight.absmax"] = absmax_codes
        tensors[f"{prefix}.weight.nested_absmax"] = nested
        tensors[f"{prefix}.weight.nested_quant_map"] = dynamic_code().clone()
        state |= {"nested_blocksize": NESTED_BLOCKSIZE, "nested_dtype": "float32", "nested_offset": offset.item()}
    else:
        tensors[f"{prefix}.weight.absmax"] = absmax.contiguous()
    tensors[f"{prefix}.{QUANT_STATE}"] = _pack_json(state)
    return tensors


def decompress(prefix: str, tensors: dict[str, torch.Tensor], scheme: WeightScheme | None = None) -> QuantizedWeight:
    """Inverse of `compress`: NF4 codes [out, in] and the absmax each block is read with."""
    state = _unpack_json(tensors[f"{prefix}.{QUANT_STATE}"], prefix)
    if state.get("quant_type") != "nf4":
        raise OptkitError(f"{prefix}: bitsandbytes quant_type {_shown(state.get('quant_type'))}: optkit reads nf4")
    out, inp, block = _checked_state(state, tensors, prefix)
    packed = tensors[f"{prefix}.weight"].reshape(-1).to(torch.uint8)
    codes = torch.stack([packed >> 4, packed & 0xF], dim=1).reshape(-1)[: out * inp].reshape(out, inp)
    code = tensors[f"{prefix}.weight.quant_map"].float()
    if not torch.equal(code, nf4_code()):
        raise OptkitError(f"{prefix}: the quant_map is not the NF4 code book: optkit reads nf4")
    absmax = tensors[f"{prefix}.weight.absmax"]
    if "nested_offset" in state:
        nested_map = tensors[f"{prefix}.weight.nested_quant_map"].float()
        if not torch.equal(nested_map, dynamic_code()):
            raise OptkitError(f"{prefix}: the nested quant_map is not bitsandbytes' dynamic map: re-create it")
        offset = torch.tensor(float(state["nested_offset"]))
        absmax = double_dequantize(absmax, tensors[f"{prefix}.weight.nested_absmax"], offset, absmax.shape)
    scale = absmax.float().reshape(out, inp // block)
    read_scheme = WeightScheme(bits=4, group_size=block, type="nf4", double_quant="nested_offset" in state)
    return QuantizedWeight(codes, scale, torch.zeros(scale.shape, dtype=torch.int8), read_scheme)


def scheme_from_config(quant_config: dict) -> WeightScheme:
    if not quant_config.get("load_in_4bit") or quant_config.get("bnb_4bit_quant_type") != "nf4":
        raise OptkitError("optkit reads bitsandbytes 4-bit NF4 checkpoints (load_in_4bit, bnb_4bit_quant_type nf4)")
    return WeightScheme(
        bits=4, group_size=64, type="nf4", double_quant=bool(quant_config.get("bnb_4bit_use_double_quant"))
    )


def artifact_kind(quant_config: dict) -> ArtifactKind:
    return ArtifactKind(NAME, 4, True, type=quant_config.get("bnb_4bit_quant_type", "nf4"))


def vllm_loader(kind: ArtifactKind) -> str:
    return "bitsandbytes (pre-quantized 4-bit)"


def dequantized_state_dict(
    tensors: dict[str, torch.Tensor], quant_config: dict, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """A plain state dict: every NF4 layer replaced by its dequantized `weight`."""
    scheme_from_config(quant_config)
    prefixes = [k.removesuffix(f".{MARKER}") for k in tensors if k.endswith(f".{MARKER}")]
    owned = {f"{p}.{suffix}" for p in prefixes for suffix in SUFFIXES}
    state = {k: v for k, v in tensors.items() if k not in owned}
    for prefix in prefixes:
        state[f"{prefix}.weight"] = read_checked(prefix, lambda p: decompress(p, tensors)).dequantize(dtype)
    return state
