// int8 x int8 -> int32 matrix products for a few rows (decode), on AVX-512 VNNI CPUs: the exact
// integer result torch._int_mm computes, read straight from the weight's row-major [N, K] storage.
// Built at first use by optkit/kernels/cpu_int8_gemv.py, which documents when it runs.
//
// vpdpbusd multiplies unsigned bytes by signed bytes, so the activations go in shifted, u = a + 128
// (0..255), and the shift comes out with each output's weight sum:
//   acc[m, n] = sum_k a[m, k] w[n, k] = sum_k u[m, k] w[n, k] - 128 * sum_k w[n, k]
// exact in int32 for K < 2^31 / (255 * 128) = 65,793 columns (|u w| <= 255 * 128).
// Each output row n is read once and serves every activation row m (M <= kMaxRows, in registers).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

// Activation rows one call takes: past 8 the activation loads bound it and oneDNN's GEMM is faster
// (bench/cpu_int8_gemv.py: 1.2-1.7x _int_mm at 8 rows, 0.5-0.9x at 16).
constexpr int64_t kMaxRows = 8;
constexpr int64_t kMaxColumns = 65792;  // K above which the int32 sum of shifted products could overflow
// How far ahead of its loads a thread asks for the weight rows (bytes), as cpu_w4a8.cpp's kernel: the
// hardware prefetcher alone falls short of the memory's bandwidth (bench/cpu_prefetch.py)
constexpr int kPrefetchBytes = 4096;

bool cpu_has_vnni() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

#if defined(__x86_64__)
// Rows n of w [N, K] against MR shifted activation rows u [MR, K], 64 columns a step; the last K % 64
// columns read with a mask (zeros past K add nothing).
template <int MR>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) void rows_vnni(
    const int8_t* w, const uint8_t* u, const int32_t* w_sums, int32_t* acc, int64_t n_begin, int64_t n_end,
    int64_t N, int64_t K) {
  const int64_t full = K / 64, tail = K % 64;
  const __mmask64 tail_mask = tail ? (~0ULL >> (64 - tail)) : 0;
  for (int64_t n = n_begin; n < n_end; ++n) {
    const int8_t* wn = w + n * K;
    __m512i s[MR];
    for (int r = 0; r < MR; ++r) s[r] = _mm512_setzero_si512();
    for (int64_t c = 0; c < full; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(wn + 64 * c + kPrefetchBytes), _MM_HINT_T0);
      const __m512i wv = _mm512_loadu_si512(wn + 64 * c);
      for (int r = 0; r < MR; ++r)
        s[r] = _mm512_dpbusd_epi32(s[r], _mm512_loadu_si512(u + r * K + 64 * c), wv);
    }
    if (tail) {  // zero weights past K: their products vanish
      const __m512i wv = _mm512_maskz_loadu_epi8(tail_mask, wn + 64 * full);
      for (int r = 0; r < MR; ++r)
        s[r] = _mm512_dpbusd_epi32(s[r], _mm512_maskz_loadu_epi8(tail_mask, u + r * K + 64 * full), wv);
    }
    for (int r = 0; r < MR; ++r) acc[r * N + n] = _mm512_reduce_add_epi32(s[r]) - 128 * w_sums[n];
  }
}
#endif

// a int8 [M, K], w int8 [N, K] row-major, w_sums int32 [N] (each row's sum) -> int32 [M, N] = a @ w.T
at::Tensor int8_gemv(const at::Tensor& a, const at::Tensor& w, const at::Tensor& w_sums) {
  TORCH_CHECK_VALUE(a.dim() == 2 && w.dim() == 2 && a.scalar_type() == at::kChar && w.scalar_type() == at::kChar &&
                        a.size(1) == w.size(1),
                    "int8 gemv: a int8 [M, K] and w int8 [N, K]; got ", a.sizes(), " and ", w.sizes());
  const int64_t M = a.size(0), K = a.size(1), N = w.size(0);
  TORCH_CHECK_VALUE(M >= 1 && M <= kMaxRows && K >= 1 && K <= kMaxColumns,
                    "int8 gemv: 1 to ", kMaxRows, " rows of 1 to ", kMaxColumns, " columns; got ", a.sizes());
  TORCH_CHECK_VALUE(w_sums.scalar_type() == at::kInt && w_sums.numel() == N && w_sums.is_contiguous(),
                    "int8 gemv: w_sums int32 [N]; got ", w_sums.sizes());
  TORCH_CHECK(w.is_contiguous(), "w: contiguous [N, K]");
  TORCH_CHECK(cpu_has_vnni(), "int8 gemv: this CPU lacks AVX-512 VNNI");
  const at::Tensor ac = a.contiguous();
  at::Tensor u = at::empty({M, K}, a.options().dtype(at::kByte));
  const int8_t* ap = ac.data_ptr<int8_t>();
  uint8_t* up = u.data_ptr<uint8_t>();
  for (int64_t i = 0; i < M * K; ++i) up[i] = static_cast<uint8_t>(ap[i] + 128);
  at::Tensor acc = at::empty({M, N}, a.options().dtype(at::kInt));
#if defined(__x86_64__)
  const int8_t* wp = w.data_ptr<int8_t>();
  const int32_t* sp = w_sums.data_ptr<int32_t>();
  int32_t* out = acc.data_ptr<int32_t>();
  using Rows = void (*)(const int8_t*, const uint8_t*, const int32_t*, int32_t*, int64_t, int64_t, int64_t, int64_t);
  static constexpr Rows kRows[kMaxRows] = {
      rows_vnni<1>, rows_vnni<2>, rows_vnni<3>, rows_vnni<4>, rows_vnni<5>, rows_vnni<6>, rows_vnni<7>, rows_vnni<8>};
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) { kRows[M - 1](wp, up, sp, out, begin, end, N, K); });
#endif
  return acc;
}

}  // namespace

TORCH_LIBRARY(optkit_int8_gemv, m) {
  m.def("gemv(Tensor a, Tensor w, Tensor w_sums) -> Tensor", &int8_gemv);
  m.def("has_vnni() -> bool", &cpu_has_vnni);
  m.def("max_rows() -> int", []() -> int64_t { return kMaxRows; });
  m.def("max_columns() -> int", []() -> int64_t { return kMaxColumns; });
}
