"""Valid files the fuzzer mutates: tiny GGUF files written with gguf-py as llama.cpp's converter lays
them out (each passes every check of `optkit verify`), the config.json of each supported family,
an optkit artifact's manifest, and the bundled recipes. Deterministic: the same bytes every run."""

import json
import shutil
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
MISSING_MODEL = "/nonexistent/fuzz-base-model"  # a recipe's model that never resolves: nothing is quantized
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
# (architecture, block type of the linears, general.alignment or None, tied embeddings, q/k/v biases)
GGUF_SEEDS = (
    ("llama", "Q8_0", None, False, False),
    ("qwen3", "Q4_0", 64, True, False),
    ("qwen2", "Q4_1", None, False, True),
)
HIDDEN, FFN, HEADS, KV_HEADS, VOCAB, BLOCKS = 32, 64, 4, 2, 32, 2


def _blocks(rng: np.random.Generator, rows: int, cols: int, qtype: str) -> np.ndarray:
    """uint8 [rows, cols/32 · block bytes]: ggml blocks with finite fp16 scales (and minima)."""
    halves = {"Q4_0": 1, "Q4_1": 2, "Q8_0": 1}[qtype]
    quants = 32 if qtype == "Q8_0" else 16
    n = rows * cols // 32
    scales = rng.uniform(0.001, 0.05, size=(n, halves)).astype(np.float16).view(np.uint8).reshape(n, 2 * halves)
    qs = rng.integers(0, 256, size=(n, quants), dtype=np.uint8)
    return np.concatenate([scales, qs], axis=1).reshape(rows, -1)


def write_gguf_seed(path: Path, arch: str, qtype: str, alignment: int | None, tied: bool, biases: bool) -> Path:
    import gguf

    rng = np.random.default_rng(len(arch) * 7 + len(qtype))
    writer = gguf.GGUFWriter(path, arch)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(f"fuzz-{arch}")
    writer.add_quantized_by("optkit")
    writer.add_file_type({"Q4_0": 2, "Q4_1": 3, "Q8_0": 7}[qtype])
    writer.add_block_count(BLOCKS)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    if arch == "qwen3":
        writer.add_key_length(HIDDEN // HEADS)
        writer.add_value_length(HIDDEN // HEADS)
    if arch == "llama":
        writer.add_vocab_size(VOCAB)
        writer.add_rope_dimension_count(HIDDEN // HEADS)
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(2.0)
    tokens = ["<s>", "</s>", *[chr(ord("a") + i) for i in range(26)], "ab", "cd", "abcd", "\u0120a"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL] * 2 + [gguf.TokenType.NORMAL] * (VOCAB - 2))
    writer.add_token_merges(["a b", "c d", "ab cd"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(True)
    writer.add_chat_template(TEMPLATE)
    manifest = {"method": "rtn", "options": {"weights": {"bits": 4, "group_size": 32, "symmetric": True}}}
    writer.add_string("optkit.manifest", json.dumps({**manifest, "calibration": {"name": None}}))

    raw = getattr(gguf.GGMLQuantizationType, qtype)
    head_dim = HIDDEN // HEADS

    def norm(name: str, size: int = HIDDEN) -> None:
        writer.add_tensor(name, (1 + 0.1 * rng.standard_normal(size)).astype(np.float32))

    writer.add_tensor("token_embd.weight", rng.standard_normal((VOCAB, HIDDEN)).astype(np.float16))
    for i in range(BLOCKS):
        norm(f"blk.{i}.attn_norm.weight")
        for name, rows, cols in (
            ("attn_q", HIDDEN, HIDDEN),
            ("attn_k", KV_HEADS * head_dim, HIDDEN),
            ("attn_v", KV_HEADS * head_dim, HIDDEN),
            ("attn_output", HIDDEN, HIDDEN),
            ("ffn_gate", FFN, HIDDEN),
            ("ffn_up", FFN, HIDDEN),
            ("ffn_down", HIDDEN, FFN),
        ):
            writer.add_tensor(f"blk.{i}.{name}.weight", _blocks(rng, rows, cols, qtype), raw_dtype=raw)
            if biases and name in ("attn_q", "attn_k", "attn_v"):
                writer.add_tensor(f"blk.{i}.{name}.bias", rng.standard_normal(rows).astype(np.float32))
        if arch == "qwen3":
            norm(f"blk.{i}.attn_q_norm.weight", head_dim)
            norm(f"blk.{i}.attn_k_norm.weight", head_dim)
        norm(f"blk.{i}.ffn_norm.weight")
    norm("output_norm.weight")
    if not tied:
        bf16 = (rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        writer.add_tensor(
            "output.weight", bf16.view(np.uint8).reshape(VOCAB, -1), raw_dtype=gguf.GGMLQuantizationType.BF16
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_seeds(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    return [write_gguf_seed(directory / f"{spec[0]}-{spec[1]}.gguf", *spec) for spec in GGUF_SEEDS]


def config_seeds() -> list[dict]:
    """config.json of the bundled models and of a tiny model of every family (transformers' own
    config classes fill in what each family's config.json holds)."""
    from transformers import AutoConfig

    from optkit.modeldir import BUNDLED_DIR
    from tests.tiny_families import FAMILIES, GEMMA3_TEXT, GEMMA3_VISION, TINY

    configs = [json.loads((BUNDLED_DIR / name / "config.json").read_text()) for name in ("draft", "small", "small-moe")]
    for spec in FAMILIES.values():
        spec = dict(spec)
        model_type = spec.pop("model_type")
        if model_type == "gemma3":
            text = {**TINY, **GEMMA3_TEXT, **spec, "model_type": "gemma3_text"}
            config = AutoConfig.for_model(model_type, text_config=text, vision_config=GEMMA3_VISION)
        else:
            config = AutoConfig.for_model(model_type, **{**TINY, **spec})
        configs.append(json.loads(config.to_json_string()))
    return configs


def artifact(directory: Path) -> Path:
    """A tiny optkit artifact (RTN 4-bit of `draft`) whose optkit.json the manifest fuzzer mutates."""
    from optkit.modeldir import BUNDLED_DIR
    from optkit.quant.quantize import QuantizeOptions, quantize_model
    from optkit.weights.schemes import WeightScheme

    out = directory / "draft-w4"
    quantize_model(
        BUNDLED_DIR / "draft", out, QuantizeOptions(method="rtn", weights=WeightScheme(bits=4, group_size=32))
    )
    return out


def recipe_seeds() -> list[str]:
    """The bundled recipes (templates included), each with a base model that never resolves."""
    texts = []
    for path in sorted((REPO / "recipes").glob("*.yaml")):
        lines = path.read_text().splitlines()
        texts.append("\n".join(f"model: {MISSING_MODEL}" if ln.startswith("model:") else ln for ln in lines) + "\n")
    return texts


def model_dir_for_configs(directory: Path) -> Path:
    """`draft`'s weights and tokenizer: the directory each config.json mutant is dropped into."""
    from optkit.modeldir import BUNDLED_DIR

    out = directory / "model"
    shutil.copytree(BUNDLED_DIR / "draft", out)
    return out
