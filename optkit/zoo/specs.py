"""The reference models optkit builds for itself: architecture and training recipe of each."""

from dataclasses import dataclass

from optkit.errors import OptkitError

VOCAB_SIZE = 4096


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
}


def get_spec(name: str) -> ZooSpec:
    if name not in SPECS:
        raise OptkitError(f"unknown reference model {name!r}: choose one of {', '.join(SPECS)}")
    return SPECS[name]
