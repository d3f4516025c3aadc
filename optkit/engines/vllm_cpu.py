"""Which of vLLM-CPU's kernel libraries this machine runs (vllm/platforms/cpu.py `import_kernels`):
`_C` (AVX-512 with BF16; its int8 W8A8 linears take the SGL kernel where the CPU has AMX tiles),
`_C_AVX512`, or `_C_AVX2`, which has no weight-only int kernel (`cpu_gemm_wna16`). vLLM runs in a
child process of this machine, so this process's torch answers for it."""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class VllmCpu:
    avx512: bool  # _C or _C_AVX512: cpu_gemm_wna16 is there (GPTQ, AWQ, compressed-tensors WNA16)
    amx: bool  # check_cpu_sgl_kernel: W8A8 int8 through int8_scaled_mm_with_quant, bf16/half only

    @classmethod
    def here(cls) -> "VllmCpu":
        cpu = torch.cpu
        return cls(avx512=bool(cpu._is_avx512_supported()), amx=bool(cpu._is_amx_tile_supported()))

    def describe(self) -> str:
        return "AMX" if self.amx else "AVX-512" if self.avx512 else "AVX2"
