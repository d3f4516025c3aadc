"""The bias of shadow KLD over an upstream that returns only its top-k log-probs (vLLM's maximum
is 20 unless its server raises --max-logprobs): the top-k + tail estimate against the exact KL(P_full ‖
P_quant) on `small` and its RTN artifacts, both models in this process (transformers, float32).

Two cases, as the upstream is the quantized model or the full-precision one:
- quant upstream: its top-k ids S (plus the token it was fed), P and Q at S, the rest one bucket;
- full upstream: the full model's top-k (what `--reference-cache --top-k` keeps; gate/metrics.py).
Bucketing never raises a divergence (log-sum inequality), so both estimates are lower bounds.

    python bench/upstream_topk_kld.py [--bits 2 4] [--k 5 20] [--windows 16] [--seq-len 128]
"""

import argparse
import tempfile
from pathlib import Path

import torch

from optkit.gate.metrics import Reference, full_kld, topk_kld_at


def estimates(base_logits: torch.Tensor, art_logits: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    log_p = torch.log_softmax(base_logits.float(), -1)
    log_q = torch.log_softmax(art_logits.float(), -1)
    exact = full_kld(base_logits, art_logits)
    full_ids = log_p.topk(k, -1).indices  # the full model upstream: its top-k
    full_side = topk_kld_at(Reference(full_ids, log_p.gather(-1, full_ids), exact), log_q.gather(-1, full_ids))
    quant_ids = log_q.topk(k, -1).indices  # the quantized model upstream: its top-k
    quant_side = topk_kld_at(Reference(quant_ids, log_p.gather(-1, quant_ids), exact), log_q.gather(-1, quant_ids))
    return {"exact": exact, "full upstream": full_side, "quant upstream": quant_side}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bits", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--k", type=int, nargs="+", default=[5, 20])
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from optkit.data.eval_sets import load_text_set
    from optkit.data.packing import pack_windows, tokenize_stream
    from optkit.modeldir import load_tokenizer, resolve_model_dir
    from optkit.quant.quantize import QuantizeOptions, quantize_model
    from optkit.weights.schemes import WeightScheme

    base_dir = resolve_model_dir("small")
    texts = load_text_set("heldout").texts
    windows = pack_windows(tokenize_stream(load_tokenizer(base_dir), texts), args.seq_len)[: args.windows]
    base = AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        base_logits = base(windows).logits[:, :-1]
    print(f"small, {windows.shape[0]} windows of {windows.shape[1]} tokens; mean KLD in nats (bias vs exact)")
    with tempfile.TemporaryDirectory() as tmp:
        for bits in args.bits:
            out = Path(tmp) / f"w{bits}"
            quantize_model(base_dir, out, QuantizeOptions(weights=WeightScheme(bits=bits, group_size=128)))
            art = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
            with torch.no_grad():
                art_logits = art(windows).logits[:, :-1]
            for k in args.k:
                means = {name: float(v.mean()) for name, v in estimates(base_logits, art_logits, k).items()}
                exact = means["exact"]
                parts = [f"{n} {m:.4f} ({(m - exact) / exact:+.1%})" for n, m in means.items() if n != "exact"]
                print(f"RTN w{bits} g128, k={k}: exact {exact:.4f}; " + "; ".join(parts))


if __name__ == "__main__":
    main()
