"""`optkit bench` says which kernel each quantized layer takes and what runs the decode step's norms,
RoPE and attention, the engine's own share of a decode step, and runs on the threads `--threads`
asks for."""

import json

import torch


def test_bench_names_kernels_step_overhead_and_threads(run_cli, draft_w2):
    before = torch.get_num_threads()
    try:
        code, out, err = run_cli(
            "bench", str(draft_w2), "--batch-sizes", "1", "--prompt-len", "8", "--gen-len", "6",
            "--device", "cpu", "--threads", "1", "--json",
        )  # fmt: skip
    finally:
        torch.set_num_threads(before)
    assert code == 0, err
    result = json.loads(out)
    assert result["threads"] == 1
    assert result["num_scheduler_steps"] == 8  # multi-step decoding: the CPU's default
    kernels = result["kernels"]
    # every quantized linear of draft's 2 layers, each named once: q/k/v and gate/up are fused at load
    # (models/fusion.py), so a layer runs 4: qkv, o, gate_up, down
    assert sum(kernels.values()) == 4 * 2
    from optkit.kernels import cpu_w4a8

    # the CPU default (kernels/cpu_w4a8.py), PyTorch's int4 kernel where it cannot build
    assert any(("cpu-int4" if cpu_w4a8.unavailable_reason() else "cpu-w4a8") in name for name in kernels), kernels
    from optkit.kernels import cpu_decode

    # RMSNorm, RoPE and decode attention: the C++ operators (kernels/cpu_decode.py) where they build
    reason = cpu_decode.unavailable_reason()
    assert result["decode_operators"].startswith(f"PyTorch ({reason})" if reason else "optkit C++ ("), result
    overhead = result["step_overhead"]
    # the 5 decode tokens after the first, in engine steps of up to 8 (multi-step decoding, the CPU's default)
    assert overhead["tokens"] == 5 and overhead["steps"] == 1 and 0 < overhead["overhead_s"] < overhead["step_s"]


def test_bench_refuses_zero_threads(run_cli, draft_dir):
    code, _, err = run_cli("bench", str(draft_dir), "--threads", "0")
    assert code == 2 and "--threads" in err
