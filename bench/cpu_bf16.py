"""bf16 on the CPU (issue 20), A/B in one process: the engine in fp32, in bf16 with oneDNN's packed
weights (kernels/cpu_bf16.py, what `--dtype bfloat16` loads), in plain bf16 (`F.linear`,
load_runtime_model(pack=False)), and transformers `generate` in fp32, on bench/cpu_decode.py's
random shapes and prompts (batch 1: one 64-token prompt; batch 16: 16-64 tokens; 32 new tokens).
First step by step (each engine's prefill and 32 decode steps in turn, ratios of speed: the median
over rounds of the ratio within a round), then whole runs with transformers: interleaved repeats,
tok/s are medians, ratios the medians of the ratios within a repeat.
Then how exact bf16 is: the zoo's `small` in bf16 (packed and plain) against fp32 on 16 held-out
windows of 128 tokens (relative logit error, same top token, mean KLD).

`--solo fp32|bf16|bf16-plain --batch N`: one engine alone in this process (its weights have the
caches to themselves, as a deployed model's do; in the A/B above three models evict each other): the
prefill and 40 decode steps, twice, in CPU time of the process. Run it once per dtype, alternating.

Usage: python bench/cpu_bf16.py [--shapes a,b] [--threads N] [--repeats 3] [--no-exactness]
       python bench/cpu_bf16.py --solo bf16 --shapes a --batch 1 --threads 1
"""

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # bench/cpu_decode.py

import cpu_decode as cd  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="a,b")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-exactness", action="store_true")
    p.add_argument("--solo", choices=["fp32", "bf16", "bf16-plain"], default=None)
    p.add_argument("--batch", type=int, choices=[1, cd.BATCH], default=1, help="with --solo")
    return p.parse_args()


def solo(shape: str, kind: str, batch: int, log) -> None:
    from unittest import mock

    from optkit.runtime.sequence import SamplingParams

    paths = cd.build(shape, 64, log)
    vocab = cd.SHAPES[shape]["vocab_size"]
    rng = random.Random(0)
    one = [[rng.randrange(vocab) for _ in range(cd.PROMPT_LEN)]]
    mixed = [[rng.randrange(vocab) for _ in range(rng.randint(*cd.MIXED))] for _ in range(cd.BATCH)]
    prompts = one if batch == 1 else mixed
    if kind == "bf16-plain":
        with mock.patch("optkit.kernels.cpu_bf16.available", return_value=False):
            engine = cd.engine(paths["base"], "bfloat16")
    else:
        engine = cd.engine(paths["base"], "float32" if kind == "fp32" else "bfloat16")
    params = SamplingParams(max_tokens=41, temperature=0, ignore_eos=True)
    for k in range(2):  # the first pass warms up
        for i, p in enumerate(prompts):
            engine.add_request(p, params, f"solo-{k}-{i}")
        start = time.process_time()
        engine.step()
        prefill = time.process_time() - start
        steps = []
        while engine.has_unfinished():
            start = time.process_time()
            engine.step()
            steps.append(time.process_time() - start)
    print(
        f"solo shape ({shape}) batch {batch} {kind}: prefill {prefill * 1e3:.1f} ms, "
        f"decode step median {statistics.median(steps) * 1e3:.1f} ms (CPU time)"
    )


def speed(shape: str, repeats: int, log) -> None:
    from unittest import mock

    import torch

    from optkit.runtime.benchmark import load_hf

    paths = cd.build(shape, 64, log)
    vocab = cd.SHAPES[shape]["vocab_size"]
    rng = random.Random(0)
    one = [[rng.randrange(vocab) for _ in range(cd.PROMPT_LEN)]]
    mixed = [[rng.randrange(vocab) for _ in range(rng.randint(*cd.MIXED))] for _ in range(cd.BATCH)]
    engines = {"fp32": cd.engine(paths["base"], "float32"), "bf16 packed": cd.engine(paths["base"], "bfloat16")}
    with mock.patch("optkit.kernels.cpu_bf16.available", return_value=False):  # the loader packs nothing
        engines["bf16 plain"] = cd.engine(paths["base"], "bfloat16")
    assert not any(type(m).__name__ == "PackedBf16Linear" for m in engines["bf16 plain"].model.modules())
    hf = load_hf(paths["base"], torch.float32, "cpu")
    runs = {name: (lambda p, e=e: cd.run_engine(e, p, cd.GEN_LEN)) for name, e in engines.items()}
    runs["transformers"] = lambda p: cd.run_hf(hf, p, cd.GEN_LEN)
    for run in runs.values():
        run([one[0][:8]])
    for batch, prompts in ((1, one), (cd.BATCH, mixed)):  # step by step, interleaved
        times = step_times(engines, prompts, cd.GEN_LEN)
        decode = {name: t[1:] for name, t in times.items()}
        cells = [
            f"{a} / {b}: prefill {times[b][0] / times[a][0]:.2f}x, decode step "
            f"{cd.paired_ratio(decode[b], decode[a]):.2f}x"
            for a, b in (("bf16 packed", "fp32"), ("bf16 plain", "fp32"), ("bf16 packed", "bf16 plain"))
        ]
        medians = ", ".join(f"{name} {statistics.median(t) * 1e3:.1f} ms" for name, t in decode.items())
        print(f"shape ({shape}), batch {batch}, decode step medians: {medians}\n  speed " + "; ".join(cells))
    for batch, prompts in ((1, one), (cd.BATCH, mixed)):
        tps: dict[str, list[float]] = {name: [] for name in runs}
        for r in range(repeats):
            for name in list(runs)[r % len(runs) :] + list(runs)[: r % len(runs)]:
                tps[name].append(runs[name](prompts))

        pairs = [("bf16 packed", "fp32"), ("bf16 plain", "fp32"), ("bf16 packed", "bf16 plain")]
        pairs.append(("fp32", "transformers"))
        medians = ", ".join(f"{name} {statistics.median(v):.1f}" for name, v in tps.items())
        ratios = ", ".join(f"{a} / {b} {cd.paired_ratio(tps[a], tps[b]):.2f}x" for a, b in pairs)
        print(f"shape ({shape}), batch {batch}: {medians} tok/s\n  {ratios}", flush=True)


def step_times(engines: dict, prompts: list[list[int]], steps: int) -> dict[str, list[float]]:
    """Prefill, then `steps` decode steps, each engine in turn step by step (the order rotating every
    round): each round's steps are a fraction of a second apart, so the machine's load, which moves
    by 3x over a minute here, is nearly the same for every engine within a round. Index 0 is the
    prefill."""
    from optkit.runtime.sequence import SamplingParams

    params = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    for name, e in engines.items():
        for i, p in enumerate(prompts):
            e.add_request(p, params, f"ab-{name}-{i}-{time.perf_counter()}")
    times: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(steps + 1):
        names = list(engines)[r % len(engines) :] + list(engines)[: r % len(engines)]
        for name in names:
            start = time.perf_counter()
            engines[name].step()
            times[name].append(time.perf_counter() - start)
    assert not any(e.has_unfinished() for e in engines.values())
    return times


def exactness() -> None:
    import torch
    import torch.nn.functional as F

    from optkit.data.eval_sets import load_text_set
    from optkit.modeldir import load_tokenizer, resolve_model_dir
    from optkit.models.loader import load_runtime_model
    from optkit.models.paged_lm import PagedLM

    path = resolve_model_dir("small")
    ids = load_tokenizer(path).encode("\n".join(load_text_set("heldout").texts[:40]))
    windows = torch.tensor([ids[i * 128 : (i + 1) * 128] for i in range(16)])
    ref = PagedLM(load_runtime_model(path, dtype=torch.float32))(windows).logits
    for name, pack in (("bf16 packed", True), ("bf16 plain", False)):
        got = PagedLM(load_runtime_model(path, dtype=torch.bfloat16, pack=pack))(windows).logits
        rel = ((got - ref).norm() / ref.norm()).item()
        same = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        kld = F.kl_div(got.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none").sum(-1).mean()
        print(f"small, {name} vs fp32: relative logit error {rel:.2e}, same top token {same:.2%}, mean KLD {kld:.2e}")


def main() -> None:
    args = parse_args()
    from optkit.devices import set_cpu_threads

    set_cpu_threads(args.threads)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if args.solo is not None:
        for shape in args.shapes.split(","):
            solo(shape, args.solo, args.batch, log)
        return
    for shape in args.shapes.split(","):
        speed(shape, args.repeats, log)
    if not args.no_exactness:
        exactness()


if __name__ == "__main__":
    main()
