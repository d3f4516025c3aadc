// The x86 instruction sets optkit's CPU kernels choose between, read from cpuid once per call site.
// Included by cpu_int8_gemv.cpp, cpu_w4a8_tiles.h and cpu_decode.cpp; Python caps the choice with
// cpp_build.capped_isa (OPTKIT_CPU_ISA=avx2).
#pragma once

#include <cstdint>

namespace cpu_isa {

// What an operator's `isa` argument names, and what best() returns: ordered, so a cap is a min
enum Isa : int64_t { kNone = 0, kAvx2 = 1, kAvx512Vnni = 2 };

// AVX2 with FMA (every x86 CPU with AVX2 has both: Haswell and later, every Zen)
inline bool has_avx2_fma() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

// AVX-512 foundation, byte/word and vector-length extensions: what the fp32/bf16 loops use
inline bool has_avx512() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
#else
  return false;
#endif
}

// The best of Isa this CPU runs
inline int64_t best() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (has_avx512() && __builtin_cpu_supports("avx512vnni")) return kAvx512Vnni;
  if (has_avx2_fma()) return kAvx2;
#endif
  return kNone;
}

}  // namespace cpu_isa
