"""The Python around a 4-bit artifact's fused decode layers, A/B inside one engine (issue 38 §2).

models/fused_stack.py runs a decode step's whole decoder stack in one C++ call; without it each layer
runs in one call (models/fused_layer.py keeps each layer's weights as decode_layer_w4a8 takes them,
checked to stand at every step). This runs one request of bench/cpu_real_shapes.py's W4A16 g64
head-int4 artifact of each shape at batch 1 and switches, every 10 decode steps, between three ways
of running the same step:
  stack         as shipped: every layer in one call;
  kept          each layer in its own call, its weights kept (the stack off);
  gathered      each layer in its own call, its weights gathered again at every step (as before both).
The outputs are the same tokens (the same kernels with the same weights); printed: each way's median
step time (engine.step(), decode only), and its ratio to `stack`'s.

Usage: python bench/cpu_layer_overhead.py [--shapes smollm2-135m,gemma-3-270m] [--steps 180] [--threads 2]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/cpu_real_shapes.py
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

WAYS = ("stack", "kept", "gathered")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="smollm2-135m,gemma-3-270m")
    p.add_argument("--steps", type=int, default=180, help="decode steps of each way")
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args()


def gathered_every_step(layer, h):
    """fused_layer.w4a8_weights without what it keeps: the weights gathered at every call."""
    from optkit.kernels import cpu_decode
    from optkit.models import fused_layer

    if layer.post_norms or layer.residual_multiplier != 1.0 or not cpu_decode.enabled(h):
        return None
    derived = fused_layer.gather(layer, h)
    return None if derived.value is None or derived.hooked() else derived.value


def no_stack(*args):
    """fused_stack.decode refusing every step: the model runs its layers one by one."""
    return None


def step_times(path: Path, steps: int) -> dict[str, float]:
    """Way -> the median decode step (seconds) of one request, the ways taking turns every 10 steps."""
    from optkit.models import fused_layer, fused_stack
    from optkit.runtime.benchmark import BenchConfig, build_engine, random_prompts
    from optkit.runtime.sequence import SamplingParams

    shipped, stack = fused_layer.w4a8_weights, fused_stack.decode
    ways = {"stack": (stack, shipped), "kept": (no_stack, shipped), "gathered": (no_stack, gathered_every_step)}
    tokens = len(WAYS) * steps + 21
    engine = build_engine(path, BenchConfig(batch_sizes=[1], prompt_len=64, gen_len=tokens), enforce_eager=False)
    prompt = random_prompts(4096, 1, 64, seed=0)[0]
    engine.add_request(prompt, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True), "ab")
    engine.step()  # the prefill
    times = {way: [] for way in WAYS}
    try:
        for i in range(len(WAYS) * steps + 20):
            way = WAYS[(i // 10) % len(WAYS)]
            fused_stack.decode, fused_layer.w4a8_weights = ways[way]
            start = time.perf_counter()
            engine.step()
            if i >= 20:  # the first steps warm up
                times[way].append(time.perf_counter() - start)
    finally:
        fused_stack.decode, fused_layer.w4a8_weights = stack, shipped
    return {way: statistics.median(t) for way, t in times.items()}


def main():
    args = parse_args()
    import torch
    from cpu_real_shapes import build_artifacts, build_base

    torch.set_num_threads(args.threads)
    print(f"{'shape':14} {'way':12} {'step ms':>8} {'vs stack':>8}")
    for shape in args.shapes.split(","):
        artifact = build_artifacts(shape, build_base(shape, print), print, llama_cpp=False)["w4a16 head int4"]
        times = step_times(artifact, args.steps)
        for way, seconds in times.items():
            print(f"{shape:14} {way:12} {seconds * 1e3:8.3f} {seconds / times['stack']:7.2f}x")


if __name__ == "__main__":
    main()
