"""Compile every Triton kernel for Hopper (sm_90a) without a GPU, with the configs the wrappers pick.

The wrappers in optkit/kernels/triton are called on CPU tensors for H200-sized shapes; each kernel
launch is intercepted and compiled (TTIR -> TTGIR -> PTX -> cubin, with the ptxas bundled in triton)
instead of run. Prints registers, spills and shared memory per kernel variant, and exits non-zero
if any variant fails to compile. What this cannot tell: whether the code is right (the interpreter
tests check that) or fast (bench/gpu/kernels.py on the GPU).

Usage: python bench/gpu/compile_check.py [--arch 90] [--json]
"""

import os

os.environ.pop("TRITON_INTERPRET", None)  # compile for real; must precede importing triton

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import CUDABackend  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction, native_specialize_impl  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from optkit.kernels.packed_int import PackedIntLinear  # noqa: E402
from optkit.kernels.paged_attention import AttentionMetadata  # noqa: E402
from optkit.kernels.triton import paged_attention as pa  # noqa: E402
from optkit.kernels.triton import w4a16, w8a8  # noqa: E402
from optkit.weights.quantized import QuantizedWeight  # noqa: E402
from optkit.weights.schemes import WeightScheme  # noqa: E402

H200_SMS = 132
OPTIONS = {"num_warps", "num_stages", "num_ctas", "maxnreg"}


class Compiler:
    """Stands in for JITFunction.run: compiles each distinct launch once, records the result."""

    def __init__(self, arch: int, usage: bool = True):
        self.target = GPUTarget("cuda", arch, 32)
        self.usage = usage
        self.results: dict[str, dict] = {}

    def run(self, fn: JITFunction, args, kwargs, scenario: str):
        names = [p.name for p in fn.params]
        bound = dict(zip(names, args, strict=False)) | {k: v for k, v in kwargs.items() if k in names}
        options = {k: v for k, v in kwargs.items() if k in OPTIONS}
        signature, constexprs, attrs = {}, {}, {}
        for i, p in enumerate(fn.params):
            value = bound[p.name]
            if p.is_constexpr:
                signature[p.name], constexprs[(i,)] = "constexpr", value
                continue
            ty, attr = native_specialize_impl(CUDABackend, value, False, True, True)
            signature[p.name] = ty
            if ty == "constexpr":  # an int equal to 1, specialized as a launch would
                constexprs[(i,)] = attr
            elif attr:
                attrs[(i,)] = CUDABackend.parse_attr(attr)
        key = (
            f"{fn.__name__} {sorted((k, str(v)) for k, v in constexprs.items())} {sorted(signature.items())} {options}"
        )
        if key in self.results:
            return
        label = ", ".join(f"{names[k[0]]}={v}" for k, v in constexprs.items() if names[k[0]].isupper())
        entry = {"kernel": fn.__name__, "scenario": scenario, "config": label, **options}
        try:
            compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=self.target, options=options)
            usage = ptxas_usage(compiled.asm["ptx"], self.target) if self.usage else {}
            entry |= {"ok": True, "shared_bytes": compiled.metadata.shared, **usage}
        except Exception as e:  # report every failure, not just the first
            entry |= {"ok": False, "error": f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}"}
        self.results[key] = entry


def ptxas_usage(ptx: str, target: GPUTarget) -> dict:
    ptxas = Path(triton.backends.nvidia.__file__).parent / "bin" / "ptxas"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        arch = f"sm_{target.arch}a" if target.arch >= 90 else f"sm_{target.arch}"
        out = subprocess.run(
            [ptxas, "-v", f"--gpu-name={arch}", f.name, "-o", os.devnull], capture_output=True, text=True
        )
    text = out.stdout + out.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return {"registers": int(regs.group(1)) if regs else None, "spill_bytes": int(spills.group(1)) if spills else None}


def scenarios():
    """(name, thunk) pairs: each thunk calls a wrapper with H200-like shapes."""

    def decode(batch, context, dtype=torch.bfloat16, heads=(32, 8), dim=128, block_size=16):
        def run():
            blocks = -(-context // block_size)
            tables = [list(range(b * blocks, (b + 1) * blocks)) for b in range(batch)]
            meta = AttentionMetadata.build([1] * batch, [context] * batch, tables, [0] * batch)
            k_cache = torch.empty(batch * blocks, block_size, heads[1], dim, dtype=dtype)
            q = torch.empty(batch, heads[0], dim, dtype=dtype)
            pa.paged_attention(q, k_cache, k_cache, meta, dim**-0.5)

        return run

    def prefill(dtype=torch.bfloat16, heads=(32, 8), dim=128, block_size=16):
        def run():
            lens, ctx = [512, 1, 300], [512, 700, 1000]
            blocks = [-(-c // block_size) for c in ctx]
            tables = [list(range(sum(blocks[:b]), sum(blocks[: b + 1]))) for b in range(3)]
            meta = AttentionMetadata.build(lens, ctx, tables, [0] * sum(lens))
            k_cache = torch.empty(sum(blocks), block_size, heads[1], dim, dtype=dtype)
            q = torch.empty(sum(lens), heads[0], dim, dtype=dtype)
            pa.paged_attention(q, k_cache, k_cache, meta, dim**-0.5)
            pa.write_kv(q[:, : heads[1]], q[:, : heads[1]], k_cache, k_cache, meta.slot_mapping)

        return run

    def w4(rows, bits=4, group_size=128, act_order=False, n=8192, k=8192, dtype=torch.bfloat16):
        scheme = WeightScheme(bits=bits, group_size=group_size, symmetric=False)
        size = scheme.group_size_for(k)
        q = torch.zeros(n, k, dtype=torch.int8)
        g_idx = (torch.randperm(k) // size).to(torch.int32) if act_order else None
        scale = torch.ones(n, k // size, dtype=torch.bfloat16)
        zero = torch.zeros_like(scale, dtype=torch.int8)
        layer = PackedIntLinear.from_quantized(QuantizedWeight(q, scale, zero, scheme, g_idx))
        packed = w4a16.packed_for(layer)

        def run():
            w4a16.w4a16_linear(torch.empty(rows, k, dtype=dtype), packed, torch.empty(n, dtype=dtype))

        return run

    def w8(rows, k_major=False, static=False, n=8192, k=8192):
        weight_t = torch.empty(n, k, dtype=torch.int8).t() if k_major else torch.empty(k, n, dtype=torch.int8)

        def run():
            x = torch.empty(rows, k, dtype=torch.bfloat16)
            w8a8.int8_linear(x, weight_t, torch.empty(n), None, torch.ones(1) if static else None)

        return run

    yield from [
        ("decode b1 ctx4096", decode(1, 4096)),
        ("decode b8 ctx4096", decode(8, 4096)),
        ("decode b64 ctx2048", decode(64, 2048)),
        ("decode b4 fp16 gqa4 d64", decode(4, 1000, torch.float16, (16, 4), 64)),
        ("decode fp32 mha", decode(2, 300, torch.float32, (8, 8), 64, 8)),
        ("prefill bf16", prefill()), ("prefill fp32 d64", prefill(torch.float32, (8, 2), 64)),
        ("prefill d256 gqa2", prefill(torch.bfloat16, (16, 8), 256)),
    ]  # fmt: skip
    for rows in (1, 16, 64, 512):
        yield f"w4a16 M={rows} g128", w4(rows)
    yield from [
        ("w4a16 M=1 g32", w4(1, group_size=32)), ("w4a16 M=16 g32", w4(16, group_size=32)),
        ("w4a16 M=1 act-order", w4(1, act_order=True, n=2048, k=2048)),
        ("w4a16 M=16 act-order", w4(16, act_order=True, n=2048, k=2048)),
        ("w4a16 M=1 w8", w4(1, bits=8)),
        ("w4a16 M=16 w2", w4(16, bits=2)),
        ("w4a16 M=3 w3 fp16", w4(3, bits=3, dtype=torch.float16)),
        ("w4a16 M=4 per-channel fp32", w4(4, group_size=-1, dtype=torch.float32, n=1024, k=1024)),
    ]  # fmt: skip
    for rows in (1, 32, 512):
        yield f"w8a8 M={rows}", w8(rows)
    yield from [("w8a8 M=16 K-major", w8(16, k_major=True)), ("w8a8 M=64 static", w8(64, static=True))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for H100/H200")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--no-usage", action="store_true", help="skip the ptxas -v register report (faster)")
    args = parser.parse_args()
    compiler = Compiler(args.arch, usage=not args.no_usage)
    for module in (pa, w4a16, w8a8):
        module.num_sms = lambda device: H200_SMS  # the split heuristics as on the H200
    original_run = JITFunction.run
    for name, thunk in scenarios():
        JITFunction.run = lambda self, *a, grid, warmup, _name=name, **kw: compiler.run(self, a, kw, _name)
        try:
            thunk()
        finally:
            JITFunction.run = original_run
    rows = list(compiler.results.values())
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            usage = (
                f"{r.get('registers')} regs, {r.get('spill_bytes')} B spilled, {r['shared_bytes']} B smem"
                if r["ok"]
                else f"FAILED {r['error']}"
            )
            warps = f"w{r.get('num_warps', 4)}s{r.get('num_stages', 3)}"
            print(f"{r['kernel']:<22} {r['scenario']:<28} {warps:<5} {usage}\n    {r['config']}")
    failed = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(failed)}/{len(rows)} kernel variants compiled for sm_{args.arch}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
