"""The default mixture-of-experts calibration under other token weightings (issue 19's ablation).

In `--moe-calibration all` every calibration token passes through every expert, and token t counts
in expert e's statistics with a weight c_te (quant/moe.py: expert_token_weights). This bench swaps
that function for the alternatives below, quantizes with GPTQ (or AWQ) and gates each artifact
against the base, in one run:

  q2       c = (p / Σ_top-k p)²: the squared routing weight, extended to unrouted tokens (the default)
  q        c = p / Σ_top-k p
  p2       c = p², the router's softmax probability squared (no renormalization)
  p        c = p
  g2+F     c = g² on the routed tokens (g: the routing weight) plus a floor F on every token
  uniform  c = 1: every token alike (the calibration before issue 19)
  routed   `--moe-calibration routed`: only the routed tokens, c = 1

Usage: python bench/moe_token_weights.py [--model small-moe] [--weights q2 uniform routed]
       [--bits 3 4] [--method gptq|awq] [--num-samples 128] [--seed 0]
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

import quant_quality  # bench/quant_quality.py, beside this script
import torch

from optkit.quant import moe

DEFAULT = moe.expert_token_weights


def weighting(name: str):
    """The c_te function (router_logits [T, E], top_k, renormalize) -> [T, E] named `name`."""
    if name == "q2":
        return DEFAULT

    def weights(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> torch.Tensor:
        p = torch.softmax(router_logits.float(), dim=-1)
        top = torch.topk(p, top_k, dim=-1)
        q = p / top.values.sum(dim=-1, keepdim=True) if renormalize else p
        if name == "q":
            return q
        if name == "p2":
            return p.square()
        if name == "p":
            return p
        if name == "uniform":
            return torch.ones_like(p)
        floor = float(name.removeprefix("g2+"))
        routed = torch.zeros_like(p).scatter_(1, top.indices, 1.0)
        return (q * routed).square() + floor

    return weights


def known(name: str) -> bool:
    if name.startswith("g2+"):
        try:
            return float(name.removeprefix("g2+")) >= 0
        except ValueError:
            return False
    return name in ("q2", "q", "p2", "p", "uniform", "routed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small-moe")
    parser.add_argument("--weights", nargs="+", default=["q2", "uniform", "routed"])
    parser.add_argument("--bits", nargs="+", type=int, default=[3])
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--method", choices=["gptq", "awq"], default="gptq")
    parser.add_argument("--num-samples", type=int, default=128, help="calibration sequences")
    parser.add_argument("--seed", type=int, default=0, help="calibration seed")
    parser.add_argument("--eval-set", default="heldout")
    args = parser.parse_args()
    for name in args.weights:
        if not known(name):
            parser.error(f"--weights {name}: choose q2, q, p2, p, g2+FLOOR (e.g. g2+0.01), uniform or routed")
    if args.method == "awq" and "routed" in args.weights:
        parser.error("--weights routed is a GPTQ variant of quant_quality.py: use it with --method gptq")
    functions = {name: None if name == "routed" else weighting(name) for name in args.weights}
    quant_quality.RUN.num_samples = args.num_samples
    label = {"gptq": "gptq", "awq": "awq asym"}[args.method]
    with tempfile.TemporaryDirectory() as tmp:
        quant_quality.keep_tensors_out_of_the_heap()
        for name, function in functions.items():
            moe.expert_token_weights = function or DEFAULT
            for bits in args.bits:
                variant = "gptq routed" if function is None else label
                out = Path(tmp) / f"{name}-w{bits}"
                r = quant_quality.run_variant(args.model, out, variant, bits, args.group_size, args.eval_set, args.seed)
                row = {"weights": name, "method": args.method, "bits": bits, "num_samples": args.num_samples}
                row |= {k: r[k] for k in ("seed", "ppl", "ppl_increase_pct", "kld_mean", "top1_pct", "quantize_s")}
                print(json.dumps(row), flush=True)
    moe.expert_token_weights = DEFAULT


if __name__ == "__main__":
    sys.exit(main())
