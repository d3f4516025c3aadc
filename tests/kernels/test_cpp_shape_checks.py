"""optkit's C++ operators refuse shapes they cannot take (a hidden size of 0, a head count that the
KV heads do not divide, a group size of 0 or one that does not divide K) with a ValueError naming
the shapes, never a division by zero that kills the process with SIGFPE; their Python wrappers turn
it into one OptkitError line. Each case runs in a child process, so that a signal fails the test
instead of ending the test session."""

import subprocess
import sys

import pytest

from optkit.kernels import cpu_decode, cpu_w4a8

DECODE = pytest.mark.skipif(bool(cpu_decode.unavailable_reason()), reason="the C++ decode operators do not build here")
W4A8 = pytest.mark.skipif(bool(cpu_w4a8.unavailable_reason()), reason="the W4A8 kernel does not build here")

CHILD = """
import torch
from optkit.errors import OptkitError
from optkit.kernels import cpu_decode, cpu_w4a8
cpu_decode.unavailable_reason(), cpu_w4a8.unavailable_reason()  # build or find and load the libraries

def attention_args(q_heads, kv_heads, block_size=16):
    q = torch.randn(1, q_heads, 32)
    cache = torch.randn(2, block_size, kv_heads, 32)
    return q, cache, cache.clone(), torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long)

def w4a8_args(group_size, k=64):
    x = torch.randn(1, k)
    weight = torch.zeros(1, k // 32, 256, dtype=torch.uint8)
    params = torch.zeros(1, max(k // max(group_size, 1), 1), 2, 16)
    return x, weight, params, None, 16, group_size, cpu_w4a8.selected_isa()

for call in CALLS:
    try:
        eval(call)
    except Exception as e:
        print("raised", type(e).__name__, str(e).splitlines()[0])
    else:
        print("returned")
"""


def run_child(*calls: str) -> list[str]:
    """What each call did, in one fresh process: 'raised TYPE MESSAGE' or 'returned'; fails on a signal."""
    code = f"CALLS = {list(calls)!r}\n{CHILD}"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"the child died (exit {done.returncode}): {done.stderr[-2000:]}"
    return done.stdout.strip().splitlines()[-len(calls) :]


CASES = {
    "rms_norm of width 0": (
        DECODE,
        "torch.ops.optkit_cpu.rms_norm(torch.empty(3, 0), torch.empty(0), 1e-6, True, 0.0)",
        "cpu_decode.rms_norm(torch.empty(3, 0), torch.empty(0), 1e-6)",
        "K >= 1",
    ),
    "decode attention with no KV heads": (
        DECODE,
        "torch.ops.optkit_cpu.decode_attention(*attention_args(4, 0), 0.2, 0, False)",
        "cpu_decode.decode_attention(*attention_args(4, 0), 0.2, None)",
        "Hq a multiple of Hkv",
    ),
    "decode attention, Hq not a multiple of Hkv": (
        DECODE,
        "torch.ops.optkit_cpu.decode_attention(*attention_args(4, 3), 0.2, 0, False)",
        "cpu_decode.decode_attention(*attention_args(4, 3), 0.2, None)",
        "Hq a multiple of Hkv",
    ),
    "decode attention, blocks of 0 slots": (
        DECODE,
        "torch.ops.optkit_cpu.decode_attention(*attention_args(4, 2, block_size=0), 0.2, 0, False)",
        "cpu_decode.decode_attention(*attention_args(4, 2, block_size=0), 0.2, None)",
        "block_size at least 1",
    ),
    "rope with an odd rotary width": (
        DECODE,
        "torch.ops.optkit_cpu.rope(torch.randn(2, 4, 32), torch.randn(2, 1, 7), torch.randn(2, 1, 7))",
        "cpu_decode.rope(torch.randn(2, 4, 32), torch.randn(2, 1, 7), torch.randn(2, 1, 7))",
        "rotary dims",
    ),
    "w4a8 with groups of 0 columns": (
        W4A8,
        "torch.ops.optkit_w4a8.linear(*w4a8_args(0))",
        "cpu_w4a8.w4a8_linear(torch.randn(1, 64), cpu_w4a8.W4A8Packed(*w4a8_args(0)[1:3], 0, None, 64, 16))",
        "group size 0",
    ),
    "w4a8 with groups that do not divide K": (
        W4A8,
        "torch.ops.optkit_w4a8.linear(*w4a8_args(96))",
        "cpu_w4a8.w4a8_linear(torch.randn(1, 64), cpu_w4a8.W4A8Packed(*w4a8_args(96)[1:3], 96, None, 64, 16))",
        "group size 96",
    ),
}


@pytest.mark.parametrize(
    "case", [pytest.param(name, marks=mark) for name, (mark, *_) in CASES.items()], ids=list(CASES)
)
def test_an_impossible_shape_raises_and_never_kills_the_process(case):
    _, op_call, wrapper_call, fragment = CASES[case]
    op, wrapper = run_child(op_call, wrapper_call)
    assert op.startswith("raised ValueError") and fragment in op, op
    assert wrapper.startswith("raised OptkitError") and fragment in wrapper, wrapper
    assert "check config.json against the checkpoint" in wrapper
