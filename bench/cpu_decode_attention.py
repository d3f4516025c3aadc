"""Decode attention on the CPU, side by side in one process: optkit's C++ operator (kernels/cpu_decode.py's
decode_attention, what a decode step runs) against the PyTorch path it replaced (the blocks gathered
by index_select, masked SDPA), one query token per sequence over a paged KV cache of random float32
keys and values, on the attention shapes of real small models at batch 1 to 64. Each "layer" has its
own cache (--layers of them, called in turn) so that, as in a decode step, K and V come from memory
once they outgrow the last-level cache. Figures: the median over interleaved repeats of the mean time
per layer; the ratio, the median of the ratios within a repeat; GB/s, the K and V bytes of one layer
read once per call. The outputs are checked to agree (float32 rounding) on every shape.

With --baseline REV, optkit/kernels/cpu_decode.cpp and its headers as they were at git revision REV
are built beside the shipped operator under a namespace of their own (bench/kernel_baseline.py) and
timed in the same repeats, both operators called directly: its time per layer, the median of the
per-repeat ratios to the shipped operator's (> 1: the shipped one faster), and whether the two give
the same bits.

Usage: python bench/cpu_decode_attention.py [--threads 2] [--batch-sizes 1,16,64] [--context 96]
       [--layers 8] [--repeats 5] [--baseline REV]
"""

import argparse
import contextlib
import statistics

import torch
from cpu_w4_kernel import timed  # bench/ is the script's directory: on sys.path

SHAPES = {  # name -> (query heads, KV heads, head dim)
    "SmolLM2-135M": (9, 3, 64),
    "Gemma-3-270M": (4, 1, 256),
    "Qwen3-0.6B": (16, 8, 128),
}
BLOCK_SIZE = 16


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-sizes", default="1,16,64")
    p.add_argument("--context", type=int, default=96, help="keys per sequence (a 64-token prompt and 32 new)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--baseline", help="a git revision whose cpu_decode.cpp to time beside the shipped one")
    return p.parse_args()


def baseline_operator(revision: str):
    """cpu_decode.cpp's decode_attention as it was at `revision`."""
    from kernel_baseline import build_at

    return getattr(torch.ops, build_at(revision, "cpu_decode.cpp", "optkit_cpu")).decode_attention


def operator_args(q, k_cache, v_cache, meta, scale) -> tuple:
    """The arguments paged_attention gives the C++ operator for this step (its block tables and lens)."""
    from optkit.kernels import cpu_decode
    from optkit.kernels.paged_attention import paged_attention

    made = []
    real = cpu_decode.decode_attention
    cpu_decode.decode_attention = lambda *a: made.append(a) or real(*a)
    try:
        paged_attention(q, k_cache, v_cache, meta, scale)
    finally:
        cpu_decode.decode_attention = real
    _, _, _, tables, lens, _, window = made[0]
    return tables, lens, scale, window or 0, cpu_decode.avx512()


@contextlib.contextmanager
def pytorch_path():
    """paged_attention's PyTorch code: the C++ operators off, as OPTKIT_CPU_OPS=0 turns them off."""
    from optkit.kernels import cpu_decode

    enabled = cpu_decode.enabled
    cpu_decode.enabled = lambda x: False
    try:
        yield
    finally:
        cpu_decode.enabled = enabled


def decode_layers(batch: int, heads: tuple[int, int, int], context: int, layers: int, gen: torch.Generator):
    """`layers` caches of random K and V, shuffled block tables, and one decode's metadata per sequence."""
    from optkit.kernels.paged_attention import AttentionMetadata

    q_heads, kv_heads, dim = heads
    per_seq = -(-context // BLOCK_SIZE)
    tables = torch.randperm(batch * per_seq, generator=gen).view(batch, per_seq).tolist()
    slots = [table[(context - 1) // BLOCK_SIZE] * BLOCK_SIZE + (context - 1) % BLOCK_SIZE for table in tables]
    meta = AttentionMetadata.build([1] * batch, [context] * batch, tables, slots, "cpu")
    shape = (batch * per_seq, BLOCK_SIZE, kv_heads, dim)
    caches = [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)) for _ in range(layers)]
    return torch.randn(batch, q_heads, dim, generator=gen), caches, meta


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    from optkit.kernels import cpu_decode
    from optkit.kernels.paged_attention import paged_attention

    reason = cpu_decode.unavailable_reason()
    if reason:
        raise SystemExit(f"optkit's C++ decode operators do not run here: {reason}")
    baseline = baseline_operator(args.baseline) if args.baseline else None
    extra = f" {'baseline us':>11} {'vs baseline':>11} {'same bits':>9}" if baseline else ""
    print(f"{'shape':14} {'batch':>5} {'PyTorch us':>11} {'optkit us':>10} {'GB/s':>6} {'vs PyTorch':>10}{extra}")
    for name, heads in SHAPES.items():
        scale = heads[2] ** -0.5
        for batch in map(int, args.batch_sizes.split(",")):
            q, caches, meta = decode_layers(batch, heads, args.context, args.layers, torch.Generator().manual_seed(0))

            def every_layer(q=q, caches=caches, meta=meta, scale=scale):
                for k_cache, v_cache in caches:
                    paged_attention(q, k_cache, v_cache, meta, scale)

            op_args = operator_args(q, *caches[0], meta, scale) if baseline else ()

            def every_layer_operator(op, q=q, caches=caches, args=op_args):
                for k_cache, v_cache in caches:
                    op(q, k_cache, v_cache, *args)

            with torch.inference_mode():
                ours_out = paged_attention(q, *caches[0], meta, scale)
                with pytorch_path():
                    theirs_out = paged_attention(q, *caches[0], meta, scale)
                torch.testing.assert_close(ours_out, theirs_out, atol=1e-5, rtol=1e-5)
                if baseline:
                    baseline_out = baseline(q, *caches[0], *op_args)
                    torch.testing.assert_close(ours_out, baseline_out, atol=1e-5, rtol=1e-5)
                theirs, ours, ratios, before, gains = [], [], [], [], []
                for _ in range(args.repeats):
                    with pytorch_path():
                        theirs.append(timed(every_layer, 0.2) / args.layers)
                    ours.append(timed(every_layer, 0.2) / args.layers)
                    ratios.append(theirs[-1] / ours[-1])
                    if baseline:  # both operators called alike, without paged_attention's Python around them
                        shipped = timed(lambda: every_layer_operator(torch.ops.optkit_cpu.decode_attention), 0.2)
                        before.append(timed(lambda: every_layer_operator(baseline), 0.2) / args.layers)
                        gains.append(before[-1] / (shipped / args.layers))
            t_ours = statistics.median(ours)
            kv_bytes = 2 * batch * args.context * heads[1] * heads[2] * 4
            against = ""
            if baseline:
                same = "yes" if torch.equal(ours_out, baseline_out) else "no"
                against = f" {statistics.median(before) * 1e6:>11.0f} {statistics.median(gains):>10.2f}x {same:>9}"
            print(
                f"{name:14} {batch:>5} {statistics.median(theirs) * 1e6:>11.0f} {t_ours * 1e6:>10.0f} "
                f"{kv_bytes / t_ours / 1e9:>6.1f} {statistics.median(ratios):>9.2f}x{against}"
            )
    about = f"{args.context} keys a sequence, {args.layers} layers' caches"
    print(f"\n{args.threads} threads, {about}, torch {torch.__version__}")


if __name__ == "__main__":
    main()
