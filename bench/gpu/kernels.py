"""Micro-benchmarks of the Triton kernels on a CUDA GPU (written for the H200), baselines measured in the same run.

1. Linear layers, K = N = 8192, M in 1, 16, 64: bf16 F.linear (the baseline), our W4A16 (4-bit,
   group 128, asymmetric) with its default tiles and with the best of a small sweep, the reference
   W4A16 path (dequantize, then F.linear), and torch's tinygemm `_weight_int4pack_mm`.
2. Paged attention (32 query heads, 8 KV heads, head_dim 128, block 16, bf16): decode at a few batch
   sizes and contexts, and one chunked prefill, Triton against the PyTorch path.
3. W8A8 at K = N = 8192: bf16 F.linear, our int8 path (quantize + int8 matmul + epilogue) with the
   weight as W8A8Linear stores it ([K, N] row-major) and K-major, the PyTorch path, raw `torch._int_mm`.

Every Triton result is first checked against its reference on the GPU ("check" column). Times are
medians in µs: "graph" replays the op in a CUDA graph (GPU time, no launch overhead), "eager"
launches it from Python (what the runtime pays without graphs). Each op cycles through enough copies
of its weights / KV caches to exceed the L2 cache, so nothing is timed from L2 that a model would
stream from HBM. H200 reference points are in ../shared/MEASURED.md.

Usage: python bench/gpu/kernels.py [--json] [--only linear attention int8] [--quick]
"""

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HBM_BYTES_PER_S = 4.25e12  # device-to-device copy on the H200 (MEASURED.md)
# --dry-run: every code path once on CPU under the Triton interpreter, tiny shapes, no timing
DEVICE, SIZE, DRY_RUN = "cuda", 8192, False


def sync():
    if not DRY_RUN:
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------- timing
def _median_event_ms(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_op(ops: list, *, graph_calls: int = 20, eager_calls: int = 20, repeats: int = 7) -> dict:
    """Median µs per op: `ops` are interchangeable zero-argument callables (the same op on different
    weight copies), cycled through so that each call streams its operands from HBM."""

    def cycle(calls):
        def run():
            for i in range(calls):
                ops[i % len(ops)]()

        return run

    result = {"graph_us": None, "eager_us": None}
    if DRY_RUN:
        for op in ops:
            op()
        return {"graph_us": None, "eager_us": 1.0}
    for op in ops:  # warm-up: compiles kernels, fills per-layer caches (nothing to sync inside a capture)
        op()
    torch.cuda.synchronize()
    result["eager_us"] = 1e3 * _median_event_ms(cycle(eager_calls), repeats) / eager_calls
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            cycle(len(ops))()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            cycle(graph_calls)()
        torch.cuda.synchronize()
        result["graph_us"] = 1e3 * _median_event_ms(graph.replay, repeats) / graph_calls
    except Exception as e:  # an op that cannot be captured still has its eager time
        result["note"] = f"no graph: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
        torch.cuda.synchronize()
    return result


def copies_for(bytes_per_copy: int, most: int = 16) -> int:
    if DRY_RUN:
        return 2
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 << 20) or (64 << 20)
    return max(2, min(most, math.ceil(3 * l2 / max(1, bytes_per_copy))))


@contextlib.contextmanager
def reference_path():
    """The PyTorch path of the optkit.kernels wrappers (OPTKIT_TRITON=0)."""
    old = os.environ.get("OPTKIT_TRITON")
    os.environ["OPTKIT_TRITON"] = "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["OPTKIT_TRITON"]
        else:
            os.environ["OPTKIT_TRITON"] = old


def check(out: torch.Tensor, expected: torch.Tensor, tol: float) -> str:
    err = ((out.float() - expected.float()).abs().max() / expected.float().abs().max().clamp(min=1e-6)).item()
    return f"ok {err:.1e}" if err <= tol else f"MISMATCH {err:.1e}"


def row(group, name, shape, timing, baseline_us=None, bytes_moved=None, **extra) -> dict:
    r = {"group": group, "name": name, "shape": shape, **timing, **extra}
    us = r.get("graph_us") or r.get("eager_us")
    if baseline_us and us:
        r["vs_baseline"] = round(baseline_us / us, 2)  # > 1: faster than the baseline
    if bytes_moved and us:
        r["hbm_fraction"] = round(bytes_moved / (us * 1e-6) / HBM_BYTES_PER_S, 2)
    return r


def guarded(rows: list, group: str, name: str, shape: str):
    """Runs a benchmark body; a failure becomes a row instead of ending the run."""

    @contextlib.contextmanager
    def scope():
        try:
            yield
        except Exception as e:
            rows.append({"group": group, "name": name, "shape": shape, "note": f"FAILED {type(e).__name__}: {e}"[:160]})
            sync()

    return scope()


# --------------------------------------------------------------------------------------- linear
def w4a16_layers(n: int, k: int, count: int, group_size: int = 128):
    from optkit.kernels.packed_int import PackedIntLinear
    from optkit.weights.quantized import QuantizedWeight
    from optkit.weights.schemes import WeightScheme

    scheme = WeightScheme(bits=4, group_size=group_size, symmetric=False)
    layers = []
    for _ in range(count):
        q = torch.randint(-8, 8, (n, k), dtype=torch.int8, device=DEVICE)
        scale = (torch.rand(n, k // group_size, device=DEVICE) * 0.01 + 1e-3).to(torch.bfloat16)
        zero = torch.randint(-8, 8, (n, k // group_size), dtype=torch.int8, device=DEVICE)
        layers.append(PackedIntLinear.from_quantized(QuantizedWeight(q, scale, zero, scheme)))
    return layers


def tinygemm_weight(layer, group_size: int):
    """The layer's weight in tinygemm's format: (packed, scales_and_zeros), or raise."""
    w = layer.dequantized_weight(torch.bfloat16)  # tinygemm has its own zero convention: requantize
    n, k = w.shape
    g = w.float().reshape(n, k // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-6)
    q = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).reshape(n, k)
    zero = lo + scale * 8  # w = (q - 8) * scale + zero
    scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    try:  # torch >= 2.5: uint8 [N, K / 2], two values per byte
        packed = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8)
        return torch._convert_weight_to_int4pack(packed, 8), scales_and_zeros
    except (RuntimeError, TypeError):  # older: int32 [N, K]
        return torch._convert_weight_to_int4pack(q, 8), scales_and_zeros


def bench_linear(rows: list, quick: bool):
    from optkit.kernels.triton import w4a16 as tw4

    n = k = SIZE
    bf16 = [torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) * 0.02 for _ in range(copies_for(n * k * 2, 4))]
    layers = w4a16_layers(n, k, copies_for(n * k // 2))
    weight_bytes = n * k // 2 + n * (k // 128) * 3
    sweeps = {
        1: [dict(BLOCK_N=bn, BLOCK_KW=kw, SPLIT_K=s, num_warps=w) for bn, kw, s, w in
            [(64, 16, 4, 4), (32, 16, 4, 4), (16, 16, 8, 2), (64, 16, 2, 4), (128, 16, 2, 8), (32, 16, 1, 4)]],
        16: [dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_KW=16, SPLIT_K=s, num_warps=4, num_stages=st) for bn, s, st in
             [(64, 2, 4), (64, 4, 4), (128, 2, 3), (32, 4, 4)]],
        64: [dict(BLOCK_M=64, BLOCK_N=bn, BLOCK_KW=16, SPLIT_K=s, num_warps=w, num_stages=3) for bn, s, w in
             [(64, 2, 4), (128, 1, 8), (64, 1, 4)]],
    }  # fmt: skip
    for m in (1, 16, 64):
        shape = f"M={m} K=N={n}"
        x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
        base = time_op([partial(F.linear, x, w) for w in bf16])
        rows.append(row("linear", "bf16 F.linear", shape, base, bytes_moved=n * k * 2))
        b_us = base["graph_us"] or base["eager_us"]
        with guarded(rows, "linear", "w4a16 triton", shape):
            expected = F.linear(x, layers[0].dequantized_weight(torch.bfloat16))
            status = check(layers[0](x), expected, 2e-2)
            t = time_op([partial(layer, x) for layer in layers])
            rows.append(row("linear", "w4a16 triton", shape, t, b_us, weight_bytes, check=status))
        if not quick:
            with guarded(rows, "linear", "w4a16 triton, best of sweep", shape):
                packed = [tw4.packed_for(layer) for layer in layers]
                best = None
                for config in sweeps[m]:
                    t = time_op([partial(tw4.w4a16_linear, x, p, None, **config) for p in packed], repeats=5)
                    us = t["graph_us"] or t["eager_us"]
                    if best is None or us < best[0]:
                        best = (us, config, t)
                if best:
                    status = check(tw4.w4a16_linear(x, packed[0], None, **best[1]), expected, 2e-2)
                    rows.append(row("linear", "w4a16 triton, best of sweep", shape, best[2], b_us, weight_bytes,
                                    check=status, config=str(best[1])))  # fmt: skip
        with guarded(rows, "linear", "w4a16 reference (dequantize + F.linear)", shape), reference_path():
            t = time_op([partial(layer, x) for layer in layers[:2]], eager_calls=4, graph_calls=4)
            rows.append(row("linear", "w4a16 reference (dequantize + F.linear)", shape, t, b_us))
        if DRY_RUN:  # tinygemm is CUDA-only
            continue
        with guarded(rows, "linear", "torch _weight_int4pack_mm (tinygemm)", shape):
            packs = [tinygemm_weight(layer, 128) for layer in layers]
            t = time_op([partial(torch._weight_int4pack_mm, x, p[0], 128, p[1]) for p in packs])
            rows.append(row("linear", "torch _weight_int4pack_mm (tinygemm)", shape, t, b_us, weight_bytes))


# ------------------------------------------------------------------------------------ attention
def paged_case(batch: int, context: int, query_len: int, layers: int, heads=(32, 8), dim=128, block_size=16):
    from optkit.kernels.paged_attention import AttentionMetadata

    blocks_per_seq = math.ceil(context / block_size)
    num_blocks = batch * blocks_per_seq
    perm = torch.randperm(num_blocks).tolist()  # scattered blocks, as after some serving
    tables = [perm[b * blocks_per_seq : (b + 1) * blocks_per_seq] for b in range(batch)]
    slots = [
        tables[b][t // block_size] * block_size + t % block_size
        for b in range(batch)
        for t in range(context - query_len, context)
    ]
    meta = AttentionMetadata.build([query_len] * batch, [context] * batch, tables, slots, DEVICE)
    caches = [
        tuple(torch.randn(num_blocks, block_size, heads[1], dim, device=DEVICE, dtype=torch.bfloat16) for _ in "kv")
        for _ in range(layers)
    ]
    q = torch.randn(batch * query_len, heads[0], dim, device=DEVICE, dtype=torch.bfloat16)
    return q, caches, meta


def bench_attention(rows: list, quick: bool):
    from optkit.kernels import paged_attention as pa

    cases = [(1, 1024, 1), (1, 8192, 1), (8, 2048, 1), (32, 2048, 1), (64, 4096, 1), (4, 2048, 512)]
    if quick:
        cases = [(1, 8192, 1), (32, 2048, 1), (4, 2048, 512)]
    if DRY_RUN:
        cases = [(2, 70, 1), (2, 40, 8)]
    for batch, context, query_len in cases:
        kind = "decode" if query_len == 1 else f"prefill {query_len} new"
        shape = f"{kind} B={batch} ctx={context}"
        kv_bytes = 2 * batch * context * 8 * 128 * 2
        with guarded(rows, "attention", "paged attention", shape):
            q, caches, meta = paged_case(batch, context, query_len, copies_for(kv_bytes, 32))
            scale = 128**-0.5
            with reference_path():
                expected = pa.paged_attention(q, *caches[0], meta, scale)
                ref = time_op([partial(pa.paged_attention, q, *c, meta, scale) for c in caches])
            status = check(pa.paged_attention(q, *caches[0], meta, scale), expected, 2e-2)
            ref_us = ref["graph_us"] or ref["eager_us"]
            rows.append(row("attention", "reference (gather + SDPA)", shape, ref, bytes_moved=kv_bytes))
            t = time_op([partial(pa.paged_attention, q, *c, meta, scale) for c in caches])
            rows.append(row("attention", "triton", shape, t, ref_us, kv_bytes, check=status))


# ----------------------------------------------------------------------------------------- int8
def bench_int8(rows: list, quick: bool):
    from optkit.kernels import w8a8

    n = k = SIZE
    count = copies_for(n * k)
    weights = [torch.randint(-127, 128, (k, n), dtype=torch.int8, device=DEVICE) for _ in range(count)]
    k_major = [torch.randint(-127, 128, (n, k), dtype=torch.int8, device=DEVICE).t() for _ in range(count)]
    bf16 = [torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) for _ in range(copies_for(n * k * 2, 4))]
    scale = torch.rand(n, device=DEVICE) * 1e-3
    for m in (1, 32, 256) if not quick else (1, 256):
        shape = f"M={m} K=N={n}"
        x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
        base = time_op([partial(F.linear, x, w) for w in bf16])
        rows.append(row("int8", "bf16 F.linear", shape, base, bytes_moved=n * k * 2))
        b_us = base["graph_us"] or base["eager_us"]
        expected = w8a8.int8_linear_reference(x, weights[0], scale)
        for name, ws in (("w8a8 triton, W [K, N] row-major", weights), ("w8a8 triton, W K-major", k_major)):
            with guarded(rows, "int8", name, shape):
                exp = expected if ws is weights else w8a8.int8_linear_reference(x, ws[0], scale)
                status = check(w8a8.int8_linear(x, ws[0], scale), exp, 1e-2)
                t = time_op([partial(w8a8.int8_linear, x, w, scale) for w in ws])
                rows.append(row("int8", name, shape, t, b_us, n * k, check=status))
        if m > 16:  # torch._int_mm wants M > 16
            with guarded(rows, "int8", "w8a8 reference (torch._int_mm path)", shape), reference_path():
                t = time_op([partial(w8a8.int8_linear, x, w, scale) for w in weights])
                rows.append(row("int8", "w8a8 reference (torch._int_mm path)", shape, t, b_us, n * k))
            qx = torch.randint(-127, 128, (m, k), dtype=torch.int8, device=DEVICE)
            for name, ws in (("torch._int_mm, W [K, N] row-major", weights), ("torch._int_mm, W K-major", k_major)):
                with guarded(rows, "int8", name, shape):
                    t = time_op([partial(torch._int_mm, qx, w) for w in ws])
                    rows.append(row("int8", name, shape, t, b_us, n * k))


# ---------------------------------------------------------------------------------------- output
COLUMNS = ["group", "name", "shape", "graph_us", "eager_us", "vs_baseline", "hbm_fraction", "check", "config", "note"]


def show(rows: list):
    def fmt(v):
        return "" if v is None else f"{v:.1f}" if isinstance(v, float) else str(v)

    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        table = [[fmt(r.get(c)) for c in COLUMNS] for r in rows]
        widths = [max(len(c), *(len(t[i]) for t in table)) if table else len(c) for i, c in enumerate(COLUMNS)]
        print("  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths, strict=True)))
        for t in table:
            print("  ".join(v.ljust(w) for v, w in zip(t, widths, strict=True)))
        return
    table = Table(title="Triton kernels (µs; vs_baseline > 1 is faster than the group's baseline)")
    for c in COLUMNS:
        table.add_column(c, overflow="fold")
    for r in rows:
        table.add_row(*(fmt(r.get(c)) for c in COLUMNS))
    Console(width=220).print(table)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--only", nargs="+", choices=["linear", "attention", "int8"], default=None)
    parser.add_argument("--quick", action="store_true", help="fewer shapes, no tile sweep")
    parser.add_argument(
        "--dry-run", action="store_true", help="check this script on CPU (Triton interpreter, tiny shapes)"
    )
    args = parser.parse_args()
    if args.dry_run:
        global DEVICE, SIZE, DRY_RUN
        DEVICE, SIZE, DRY_RUN = "cpu", 256, True
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
        import optkit.kernels.triton as triton_kernels

        triton_kernels.use_triton = lambda t: os.environ.get("OPTKIT_TRITON", "1") != "0"  # CPU tensors too
    elif not torch.cuda.is_available():
        print("bench/gpu/kernels.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing to measure here.",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        import triton
    except ImportError:
        print("bench/gpu/kernels.py needs triton (pip install 'optkit[gpu]').", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    device = "cpu (dry run)" if DRY_RUN else torch.cuda.get_device_name(0)
    print(f"{device}, torch {torch.__version__}, triton {triton.__version__}", file=sys.stderr)
    rows: list[dict] = []
    benches = {"linear": bench_linear, "attention": bench_attention, "int8": bench_int8}
    with torch.inference_mode():
        for name in args.only or benches:
            print(f"running {name} ...", file=sys.stderr)
            benches[name](rows, args.quick)
            if not DRY_RUN:
                torch.cuda.empty_cache()
    if args.json:
        print(json.dumps({"device": device, "torch": torch.__version__, "triton": triton.__version__, "rows": rows},
                         indent=2))  # fmt: skip
    else:
        show(rows)
    ours = [r for r in rows if "triton" in r["name"]]  # a missing baseline (tinygemm, _int_mm) is not an error
    return 1 if any("MISMATCH" in str(r.get("check", "")) or "FAILED" in str(r.get("note", "")) for r in ours) else 0


if __name__ == "__main__":
    sys.exit(main())
