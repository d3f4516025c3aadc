"""Random-weight models for the GPU benchmarks, made offline: the 1.24B Llama config in bf16 and its
W4A16 (RTN, symmetric, group 128) artifact in the gptq layout, each with a word-level tokenizer
covering the whole vocabulary (no network, no tokenizer files needed).

Usage: python bench/gpu/make_models.py OUT_DIR [--tiny]   (writes OUT_DIR/llama-1b, OUT_DIR/llama-1b-w4)
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

LLAMA_1B = dict(
    hidden_size=2048,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=8192,
    vocab_size=128256,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)
TINY = dict(
    LLAMA_1B,
    hidden_size=256,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    intermediate_size=512,
    vocab_size=1024,
)


def save_tokenizer(vocab_size: int, out: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2").save_pretrained(out)


def make_bf16(out: Path, shape: dict) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    save_tokenizer(config.vocab_size, out)


def make_w4(src: Path, out: Path) -> None:
    """RTN W4A16 g128 of every decoder linear, written as optkit's gptq artifacts are."""
    from safetensors.torch import load_file, save_file

    from optkit.quant.formats import gptq  # needs compressed_tensors importable (formats/__init__.py)
    from optkit.quant.methods.rtn.math import rtn_quantize
    from optkit.weights.schemes import WeightScheme

    scheme = WeightScheme(bits=4, group_size=128, symmetric=True)
    tensors = {}
    for file in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(file))
    out.mkdir(parents=True, exist_ok=True)
    state = {}
    for key, value in tensors.items():
        if key.startswith("model.layers.") and key.endswith("_proj.weight"):
            w = value.to("cuda" if torch.cuda.is_available() else "cpu", torch.float32)
            qw = rtn_quantize(w, scheme, scale_dtype=torch.float16)
            qw = type(qw)(qw.q.cpu(), qw.scale.cpu(), qw.zero_point.cpu(), qw.scheme, None)
            state.update(gptq.compress(key.removesuffix(".weight"), qw))
        else:
            state[key] = value
    save_file({k: v.contiguous() for k, v in state.items()}, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = gptq.quantization_config(scheme, False, ["lm_head"])
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in src.iterdir():
        if name.suffix != ".safetensors" and name.name not in ("config.json", "model.safetensors.index.json"):
            (out / name.name).write_bytes(name.read_bytes())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model, for a CPU check of this script")
    parser.add_argument("--skip-w4", action="store_true")
    args = parser.parse_args()
    bf16, w4 = args.out / "llama-1b", args.out / "llama-1b-w4"
    if not (bf16 / "config.json").exists():
        make_bf16(bf16, TINY if args.tiny else LLAMA_1B)
        print(f"wrote {bf16}", flush=True)
    if not args.skip_w4 and not (w4 / "config.json").exists():
        make_w4(bf16, w4)
        print(f"wrote {w4}", flush=True)


if __name__ == "__main__":
    main()
