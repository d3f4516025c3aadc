"""config.json as untrusted data: every size the code will build a tensor from is checked here,
before anything is allocated (modeldir.read_config calls `check_config` on each read).

A model directory comes from somewhere else: a size of 0, -5, "4" or 2^32 must end in one line
naming the key, not in a division by zero inside a kernel or a 16 GiB allocation. Only the keys a
config.json has are checked (each family supplies its own defaults); the rules that depend on the
architecture (a derived head_dim, RoPE's even dimensions) are models/config.py's.
"""

import math

from optkit.errors import OptkitError

MAX_WIDTH = 2**20  # widths, head dims, head, layer and expert counts: far past any published model
MAX_VOCAB = 2**24
MAX_POSITIONS = 2**24  # context lengths (Llama 4 Scout's 10M fits)

# key -> (smallest value, largest value)
_WHOLE_NUMBERS = {
    "vocab_size": (1, MAX_VOCAB),
    "hidden_size": (1, MAX_WIDTH),
    "intermediate_size": (1, MAX_WIDTH),
    "num_hidden_layers": (1, MAX_WIDTH),
    "num_attention_heads": (1, MAX_WIDTH),
    "num_key_value_heads": (1, MAX_WIDTH),
    "head_dim": (1, MAX_WIDTH),
    "max_position_embeddings": (1, MAX_POSITIONS),
    "original_max_position_embeddings": (1, MAX_POSITIONS),
    "sliding_window": (0, MAX_POSITIONS),  # 0: none (Qwen2-MoE's default)
    "sliding_window_pattern": (1, MAX_WIDTH),
    "max_window_layers": (0, MAX_WIDTH),
    # mixtures of experts
    "num_local_experts": (1, MAX_WIDTH),
    "num_experts": (1, MAX_WIDTH),
    "num_experts_per_tok": (1, MAX_WIDTH),
    "moe_intermediate_size": (1, MAX_WIDTH),
    "shared_expert_intermediate_size": (1, MAX_WIDTH),
    "decoder_sparse_step": (1, MAX_WIDTH),
}
# token id -> the smallest id allowed (some old Llama configs set pad_token_id -1; only EOS is used)
_TOKEN_IDS = {"eos_token_id": 0, "bos_token_id": -(2**31), "pad_token_id": -(2**31)}
# finite numbers; (key, must be > 0)
_NUMBERS = {
    "rms_norm_eps": False,
    "rope_theta": True,
    "rope_local_base_freq": True,
    "partial_rotary_factor": True,
    "embedding_multiplier": False,
    "residual_multiplier": False,
    "attention_multiplier": False,
    "logits_scaling": True,
    "query_pre_attn_scalar": True,
    "attn_logit_softcapping": True,
    "final_logit_softcapping": True,
}
# RoPE's numbers inside rope_parameters / rope_scaling; (key, must be > 0)
_ROPE_NUMBERS = {
    "rope_theta": True,
    "factor": True,
    "partial_rotary_factor": True,
    "attention_factor": False,
    "beta_fast": False,
    "beta_slow": False,
    "low_freq_factor": False,
    "high_freq_factor": False,
    "mscale": False,
    "mscale_all_dim": False,
}
MAX_NUMBER = 1e18  # far past any multiplier or RoPE base a model uses; float32 and int64 hold it
_NOT_NULL = ("rope_theta", "partial_rotary_factor")  # read without a default once the key is there
_MAPPINGS = ("quantization_config", "rope_scaling", "rope_parameters", "text_config")


def check_config(config: object, where: str) -> dict:
    """`config` (parsed config.json) when every size in it is usable, else an OptkitError naming the
    key and what to change. Gemma 3's `text_config` is checked the same way."""
    if not isinstance(config, dict):
        raise OptkitError(f"{where} holds a JSON {_json_type(config)}, not an object: re-save the model's config")
    _check_fields(config, where)
    text = config.get("text_config")
    if isinstance(text, dict):
        _check_fields(text, f"{where} text_config")
    return config


def _check_fields(config: dict, where: str) -> None:
    model_type = config.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        raise OptkitError(f"{where}: model_type is a JSON {_json_type(model_type)}, not a string: fix config.json")
    for key in _MAPPINGS:
        value = config.get(key)
        if value is not None and not isinstance(value, dict):
            raise OptkitError(f"{where}: {key} is a JSON {_json_type(value)}, not an object: fix config.json")
    for key, (low, high) in _WHOLE_NUMBERS.items():
        value = config.get(key)
        if value is not None:
            _check_whole(value, key, low, high, where)
    for key, low in _TOKEN_IDS.items():
        value = config.get(key)
        for token in value if isinstance(value, list) else [] if value is None else [value]:
            _check_whole(token, key, low, MAX_VOCAB - 1, where)
    _check_numbers(config, _NUMBERS, where)
    for key in ("rope_parameters", "rope_scaling"):
        if isinstance(config.get(key), dict):
            _check_rope(config[key], key, where)
    layers = config.get("mlp_only_layers")
    if layers is not None and not isinstance(layers, list):
        raise OptkitError(
            f"{where}: mlp_only_layers is a JSON {_json_type(layers)}, not a list of layers: fix config.json"
        )
    for layer in layers or []:
        _check_whole(layer, "mlp_only_layers", 0, MAX_WIDTH, where)
    heads, kv_heads = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if heads is not None and kv_heads is not None and heads % kv_heads:
        raise OptkitError(
            f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}: fix config.json"
        )
    experts = config.get("num_local_experts") or config.get("num_experts")
    per_token = config.get("num_experts_per_tok")
    if experts is not None and per_token is not None and per_token > experts:
        raise OptkitError(
            f"{where}: num_experts_per_tok {per_token} is more than the {experts} experts: fix config.json"
        )
    layer_types = config.get("layer_types")
    if layer_types is not None and not (isinstance(layer_types, list) and all(isinstance(t, str) for t in layer_types)):
        raise OptkitError(f"{where}: layer_types is not a list of strings: fix config.json")


def _check_numbers(config: dict, numbers: dict[str, bool], where: str, prefix: str = "") -> None:
    """Each key of `numbers` that `config` sets is a finite number of at most MAX_NUMBER, positive
    where `numbers` says so, else not negative."""
    for key, positive in numbers.items():
        value = config.get(key)
        if value is None and key in _NOT_NULL and key in config:
            raise OptkitError(f"{where}: {prefix}{key} is null: give a number or leave it out of config.json")
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise OptkitError(f"{where}: {prefix}{key} is {_shown(value)}: give a finite number in config.json")
        if value < 0 or (positive and value == 0) or value > MAX_NUMBER:
            sign = "positive" if positive else "non-negative"
            raise OptkitError(
                f"{where}: {prefix}{key} is {_shown(value)}: give a {sign} number up to {MAX_NUMBER:g} in config.json"
            )


def _check_rope(rope: dict, key: str, where: str) -> None:
    """RoPE's own numbers in rope_parameters or rope_scaling, and in Gemma 3's objects per layer type."""
    for layer_type in ("full_attention", "sliding_attention"):
        if layer_type in rope:
            if not isinstance(rope[layer_type], dict):
                shown = _json_type(rope[layer_type])
                raise OptkitError(f"{where}: {key}.{layer_type} is a JSON {shown}, not an object: fix config.json")
            _check_rope(rope[layer_type], f"{key}.{layer_type}", where)
    _check_numbers(rope, _ROPE_NUMBERS, where, prefix=f"{key}.")
    for name in ("rope_type", "type"):
        if name in rope and not isinstance(rope[name], str):
            raise OptkitError(f"{where}: {key}.{name} is {_shown(rope[name])}, not a name: fix config.json")
    if rope.get("original_max_position_embeddings") is not None:
        _check_whole(
            rope["original_max_position_embeddings"], f"{key}.original_max_position_embeddings", 1, MAX_POSITIONS, where
        )
    for name in ("short_factor", "long_factor"):
        factors = rope.get(name)
        if factors is not None and not (
            isinstance(factors, list)
            and len(factors) <= MAX_WIDTH
            and all(not isinstance(f, bool) and isinstance(f, int | float) and math.isfinite(f) for f in factors)
        ):
            raise OptkitError(f"{where}: {key}.{name} is not a list of finite numbers: fix config.json")
    low, high = rope.get("low_freq_factor"), rope.get("high_freq_factor")
    if low is not None and high is not None and not 0 < low < high:  # Llama 3's ramp divides by both and by high - low
        raise OptkitError(
            f"{where}: {key} needs 0 < low_freq_factor < high_freq_factor (got {low:g} and {high:g}): fix config.json"
        )


def _check_whole(value: object, key: str, low: int, high: int, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise OptkitError(f"{where}: {key} is {_shown(value)}, not a whole number: fix config.json")
    if not low <= value <= high:
        raise OptkitError(f"{where}: {key} is {value}: it must lie between {low} and {high}; fix config.json")


def _shown(value: object) -> str:
    """A value for an error line: JSON's spelling, never longer than a few words."""
    text = repr(value)
    return text if len(text) <= 40 else f"a JSON {_json_type(value)}"


def _json_type(value: object) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)
