"""The decode stack in one parallel region against one region per operator, A/B in one process, by
where the host has put the two CPUs (issue 38 §2).

At up to 4 sequences a step, kernels/cpu_decode.cpp's decode_stack_w4a8 runs every layer inside one
OpenMP region whose threads meet at spin barriers; before, each linear's tiles, each attention and
each quantization started and joined a region of its own (~150 a SmolLM2 step). Both decode the
same tokens (checked here before timing; tests/kernels/test_cpu_decode.py compares the logits). The
placement of the two vCPUs changes within minutes on a shared host, and with it what a hand-off
between the threads costs (4-5x), so the two paths alternate within each round, and each round is
grouped by the core-to-core round trip measured before it (bench/cpu_placement.py's groups).

Per shape of bench/cpu_real_shapes.py (its random model and --artifact, built once into its cache),
a round is: the engine decodes --gen-len greedy tokens of --batch sequences after a 64-token prompt
with one path, then with the other (which goes first alternates), each run's time per output token.
Printed per placement: rounds, the median time per token of each path and the median of the
per-round ratios (> 1: one region faster).

Usage: python bench/cpu_stack_region.py [--shapes smollm2-135m,gemma-3-270m] [--seconds 120]
       [--batch 1] [--gen-len 64] [--artifact "w4a16 head int8"] [--json out.json]
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


def same_bits(engine, prompts, gen_len: int) -> bool:
    """Whether the one region ran, and both paths decode the same tokens."""
    from optkit.kernels import cpu_decode
    from optkit.runtime.sequence import SamplingParams

    params = SamplingParams(max_tokens=gen_len, temperature=0, ignore_eos=True)
    before = cpu_decode.one_region_steps()
    one = engine.generate(prompts, params)
    ran = cpu_decode.one_region_steps() > before
    cpu_decode.stack_in_one_region(False)
    try:
        regions = engine.generate(prompts, params)
    finally:
        cpu_decode.stack_in_one_region(True)
    return ran and one == regions


def bench_shape(shape: str, args, log) -> dict:
    import torch

    from optkit.kernels import cpu_decode
    from optkit.runtime.benchmark import BenchConfig, build_engine, random_prompts

    torch.set_num_threads(args.threads)
    path = build_artifacts(shape, build_base(shape, log), log, llama_cpp=False, names=[args.artifact])[args.artifact]
    config = BenchConfig(batch_sizes=[args.batch], prompt_len=PROMPT_LEN, gen_len=args.gen_len)
    engine = build_engine(path, config, enforce_eager=False)
    prompts = random_prompts(4096, args.batch, PROMPT_LEN, seed=0)
    if not same_bits(engine, prompts, args.gen_len):
        sys.exit(
            f"{shape}: the one region did not run (it takes up to 4 sequences and 2 or more threads, at most the"
            " process's CPUs), or decoded other tokens than one region per operator"
        )
    rounds = []
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        trip = round_trip_ns()
        times = {}
        for on in (True, False) if len(rounds) % 2 else (False, True):
            cpu_decode.stack_in_one_region(on)
            times[on] = per_token_s(engine, prompts, args.gen_len)
        cpu_decode.stack_in_one_region(True)
        rounds.append({"round_trip_ns": trip, "one_region_s": times[True], "regions_s": times[False]})
    return {"shape": shape, "artifact": args.artifact, "batch": args.batch, "rounds": rounds}


def print_shape(result: dict) -> None:
    print(f"\n{result['shape']}, {result['artifact']}, batch {result['batch']}: ms a token")
    print(f"{'placement':24} {'round trip':>10} {'rounds':>6} {'regions':>8} {'one region':>10} {'ratio':>6}")
    for name, group in by_placement(result["rounds"]):
        trip = statistics.median(r["round_trip_ns"] for r in group)
        regions = statistics.median(r["regions_s"] for r in group) * 1e3
        one = statistics.median(r["one_region_s"] for r in group) * 1e3
        ratio = statistics.median(r["regions_s"] / r["one_region_s"] for r in group)
        print(f"{name:24} {trip:>7.0f} ns {len(group):>6} {regions:>8.3f} {one:>10.3f} {ratio:>5.3f}x")


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
