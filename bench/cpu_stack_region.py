"""Two ways to run a 4-bit artifact's decode step, A/B in one process, by where the host has put the
two CPUs (issue 38 §2). --compare picks the pair:
  region      the decode stack in one parallel region against one region per operator. At up to 4
              sequences a step, kernels/cpu_decode.cpp's decode_stack_w4a8 runs every layer inside
              one OpenMP region whose threads meet at spin barriers; before, each linear's tiles, each
              attention and each quantization started and joined a region of its own (~150 a SmolLM2
              step).
  token-call  a decode step in one call from its tokens to its logits (decode_token_w4a8:
              models/fused_tail.py) against the stack's call with the model's embedding, final norm
              and head called around it from Python.
Both ways decode the same tokens (checked here before timing; tests/kernels/test_cpu_decode.py and
tests/models/test_fused_tail.py compare the logits). The placement of the two vCPUs changes within
minutes on a shared host, and with it what a hand-off between the threads costs (4-5x), so the two
ways alternate within each round, and each round is grouped by the core-to-core round trip measured
before it (bench/cpu_placement.py's groups).

Per shape of bench/cpu_real_shapes.py (its random model and --artifact, built once into its cache),
a round is: the engine decodes --gen-len greedy tokens of --batch sequences after a 64-token prompt
one way, then the other (which goes first alternates), each run's time per output token. Printed
per placement: rounds, the median time per token of each way and the median of the per-round ratios
(> 1: the fused way, one region or one call, faster).

Usage: python bench/cpu_stack_region.py [--compare region|token-call] [--shapes smollm2-135m,gemma-3-270m]
       [--seconds 120] [--batch 1] [--gen-len 64] [--artifact "w4a16 head int8"] [--json out.json]
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # cpu_real_shapes.py, cpu_placement.py

from cpu_placement import by_placement, round_trip_ns  # noqa: E402
from cpu_real_shapes import ARTIFACTS, PROMPT_LEN, SHAPES, build_artifacts, build_base  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compare", choices=list(COMPARISONS), default="region")
    p.add_argument("--shapes", default="smollm2-135m,gemma-3-270m")
    p.add_argument("--seconds", type=float, default=120.0, help="of alternating rounds per shape")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--artifact", default="w4a16 head int8", choices=[n for n in ARTIFACTS if n.startswith("w4a16")])
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args()


def per_token_s(engine, prompts, gen_len: int) -> float:
    """Seconds per decode step of `gen_len` greedy tokens of every prompt (the prefill apart)."""
    from optkit.runtime.benchmark import run_engine

    return run_engine(engine, prompts, gen_len)["tpot_s"]["p50"]


class Comparison:
    """A fused way against the unfused one: `switch(on)` sets the fused way on or off (and returns the
    previous setting); `count()` grows while the fused way runs; `needs`: when it can run."""

    def __init__(self, fused: str, unfused: str, switch, count, needs: str):
        self.fused, self.unfused, self.switch, self.count, self.needs = fused, unfused, switch, count, needs


def region() -> Comparison:
    from optkit.kernels import cpu_decode

    needs = "up to 4 sequences and 2 or more threads, at most the process's CPUs"
    return Comparison("one region", "regions", cpu_decode.stack_in_one_region, cpu_decode.one_region_steps, needs)


def token_call() -> Comparison:
    from optkit.kernels import cpu_decode
    from optkit.models import fused_tail

    calls = [0]
    real = cpu_decode.decode_token_w4a8

    def counted(*args):
        calls[0] += 1
        return real(*args)

    cpu_decode.decode_token_w4a8 = counted  # this process's count of the one call
    needs = "a W4A8 head without a bias, a plain embedding table, logits neither scaled nor capped"
    return Comparison("one call", "calls", fused_tail.one_call, lambda: calls[0], needs)


COMPARISONS = {"region": region, "token-call": token_call}


def same_bits(engine, prompts, gen_len: int, comparison: Comparison) -> bool:
    """Whether the fused way ran, and both ways decode the same tokens."""
    from optkit.runtime.sequence import SamplingParams

    params = SamplingParams(max_tokens=gen_len, temperature=0, ignore_eos=True)
    before = comparison.count()
    fused = engine.generate(prompts, params)
    ran = comparison.count() > before
    comparison.switch(False)
    try:
        unfused = engine.generate(prompts, params)
    finally:
        comparison.switch(True)
    return ran and fused == unfused


def bench_shape(shape: str, args, log) -> dict:
    import torch

    from optkit.runtime.benchmark import BenchConfig, build_engine, random_prompts

    torch.set_num_threads(args.threads)
    comparison = COMPARISONS[args.compare]()
    path = build_artifacts(shape, build_base(shape, log), log, llama_cpp=False, names=[args.artifact])[args.artifact]
    config = BenchConfig(batch_sizes=[args.batch], prompt_len=PROMPT_LEN, gen_len=args.gen_len)
    engine = build_engine(path, config, enforce_eager=False)
    prompts = random_prompts(4096, args.batch, PROMPT_LEN, seed=0)
    if not same_bits(engine, prompts, args.gen_len, comparison):
        sys.exit(
            f"{shape}: {comparison.fused} did not run (it takes {comparison.needs}), or decoded other tokens than"
            f" {comparison.unfused}"
        )
    rounds = []
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        trip = round_trip_ns()
        times = {}
        for on in (True, False) if len(rounds) % 2 else (False, True):
            comparison.switch(on)
            times[on] = per_token_s(engine, prompts, args.gen_len)
        comparison.switch(True)
        rounds.append({"round_trip_ns": trip, "fused_s": times[True], "unfused_s": times[False]})
    return {"shape": shape, "compare": args.compare, "fused": comparison.fused, "unfused": comparison.unfused,
            "artifact": args.artifact, "batch": args.batch, "rounds": rounds}  # fmt: skip


def print_shape(result: dict) -> None:
    fused, unfused = result["fused"], result["unfused"]
    print(f"\n{result['shape']}, {result['artifact']}, batch {result['batch']}: ms a token")
    print(f"{'placement':24} {'round trip':>10} {'rounds':>6} {unfused:>10} {fused:>10} {'ratio':>6}")
    for name, group in by_placement(result["rounds"]):
        trip = statistics.median(r["round_trip_ns"] for r in group)
        slow = statistics.median(r["unfused_s"] for r in group) * 1e3
        fast = statistics.median(r["fused_s"] for r in group) * 1e3
        ratio = statistics.median(r["unfused_s"] / r["fused_s"] for r in group)
        print(f"{name:24} {trip:>7.0f} ns {len(group):>6} {slow:>10.3f} {fast:>10.3f} {ratio:>5.3f}x")


def main():
    args = parse_args()
    shapes = [s.strip() for s in args.shapes.split(",")]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        sys.exit(f"--shapes: no shape named {', '.join(unknown)}; the shapes: {', '.join(SHAPES)}")

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    results = []
    for shape in shapes:
        results.append(bench_shape(shape, args, log))
        print_shape(results[-1])
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
