"""The reference models optkit builds for itself: architecture and training recipe of each."""

from collections.abc import Mapping
from dataclasses import dataclass, field

from optkit.errors import OptkitError

VOCAB_SIZE = 4096
# the mixtures of experts a spec can name, and what each config class calls the spec's expert fields
MOE_KEYS = {
    "mixtral": ("num_local_experts", "num_experts_per_tok", "intermediate_size"),
    "qwen2_moe": ("num_experts", "num_experts_per_tok", "moe_intermediate_size"),
    "qwen3_moe": ("num_experts", "num_experts_per_tok", "moe_intermediate_size"),
}


@dataclass(frozen=True)
class ZooSpec:
    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    steps: int
    seq_len: int = 256
    batch_size: int = 16
    learning_rate: float = 3e-3
    warmup_steps: int = 50
    weight_decay: float = 0.1
    seed: int = 0
    # a mixture of experts (Mixtral) when num_experts > 0: intermediate_size is then one expert's
    num_experts: int = 0
    experts_per_token: int = 0
    router_aux_loss_coef: float = 0.01  # weight of the load-balancing loss added while training
    # the family: a transformers model_type, built from its config class (the family's defaults) with
    # the sizes above and `config`'s keys on top (head_dim, soft-caps, ...); an MoE is mixtral,
    # qwen2_moe or qwen3_moe (MOE_KEYS). llama's and mixtral's configs are built as they always were.
    model_type: str = "llama"
    config: Mapping = field(default_factory=dict)

    def __post_init__(self):
        if self.is_moe and self.model_type not in MOE_KEYS:
            raise OptkitError(f"{self.name}: experts need one of {', '.join(MOE_KEYS)}, not {self.model_type!r}")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def config_kwargs(self, vocab_size: int, eos_token_id: int) -> dict:
        """The transformers config of the architecture: LlamaConfig's keys (MixtralConfig's for an
        MoE), and the family's own."""
        kwargs = self.llama_config_kwargs(vocab_size, eos_token_id)
        if self.is_moe:
            experts, per_token, width = MOE_KEYS[self.model_type]
            kwargs |= {experts: self.num_experts, per_token: self.experts_per_token, width: self.intermediate_size}
            kwargs |= dict(router_aux_loss_coef=self.router_aux_loss_coef)
            if self.model_type == "mixtral":
                kwargs |= dict(sliding_window=None)
            else:  # every layer sparse, as llama.cpp's graph runs a Qwen MoE
                kwargs |= dict(decoder_sparse_step=1, mlp_only_layers=[])
        return kwargs | dict(self.config)

    def llama_config_kwargs(self, vocab_size: int, eos_token_id: int) -> dict:
        return dict(
            vocab_size=vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            max_position_embeddings=1024,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            tie_word_embeddings=True,
            bos_token_id=eos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=eos_token_id,
        )


SPECS = {
    # ~4.2M parameters: the default model of `make demo` and of the quality benchmarks.
    "small": ZooSpec(
        "small", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=768, steps=1300
    ),
    # ~0.9M parameters, same tokenizer: speculative-decoding draft and the fast test fixture.
    "draft": ZooSpec(
        "draft", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=384, steps=700
    ),
    # ~10.5M parameters: small's width and recipe at 12 layers, 500 steps (what fit the shared cores it
    # was built on), the target on which a one-layer speculative head (EAGLE) is measured against a
    # draft model. Built on demand (`optkit zoo build deep`), not committed.
    "deep": ZooSpec(
        "deep", hidden_size=256, num_layers=12, num_heads=4, num_kv_heads=2, intermediate_size=768, steps=500
    ),
    # Mixtral, 4 experts of intermediate 384, 2 per token: small's active MLP (768) and attention, ~6.6M
    # parameters in all; the reference mixture of experts (routing, per-expert calibration). A step
    # costs about small's (bench/zoo_moe_step.py); 400 steps of 8 windows, so that the build fit the
    # shared cores it was made on (docs/results.md).
    "small-moe": ZooSpec(
        "small-moe",
        hidden_size=256,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=384,
        steps=400,
        batch_size=8,
        num_experts=4,
        experts_per_token=2,
        model_type="mixtral",
    ),
    # Qwen3 at small's size (hidden 256, heads of 64, 4 layers, MLP 768), small's recipe, tokenizer and
    # data: Qwen3ForCausalLM with its per-head q/k RMSNorms, no attention biases (Qwen3Config's
    # defaults). The non-Llama family on which GGUF K-quants are measured against llama-quantize's
    # (bench/gguf_quality.py --kquants --model small-qwen3). Built on demand (`optkit zoo build
    # small-qwen3`), not committed; 800 steps: about 10 minutes of one core.
    "small-qwen3": ZooSpec(
        "small-qwen3",
        hidden_size=256,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=768,
        steps=800,
        model_type="qwen3",
        config={"head_dim": 64},
    ),
}


def get_spec(name: str) -> ZooSpec:
    if name not in SPECS:
        raise OptkitError(f"unknown reference model {name!r}: choose one of {', '.join(SPECS)}")
    return SPECS[name]
