// int8 x int8 -> int32 matrix products for a few rows (decode), on AVX-512 VNNI CPUs: the exact
// integer result torch._int_mm computes, read straight from the weight's row-major [N, K] storage;
// and a dynamic W8A8 linear around it (quantization, product, rescaling) in one call.
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

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>

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

// One row of x [K] quantized as w8a8.quantize_activations does it, stored shifted (u = q + 128); its
// scale returned. A NaN anywhere makes the scale NaN (as the infinity norm is); a NaN quotient is
// stored as 0, as PyTorch's conversion to int8 gives here (the outputs are NaN either way, and an
// infinite x gives an infinite scale, whose NaN quotients this keeps as PyTorch does).
__attribute__((target("avx512f,avx512bw,avx512vl"))) float quantize_row_shifted(const float* x, int64_t K, uint8_t* u) {
  __m512 vmax = _mm512_setzero_ps();
  __mmask16 unordered = 0;
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 mask = K - k >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (K - k)) - 1u);
    const __m512 v = _mm512_maskz_loadu_ps(mask, x + k);  // zeros past K: |0| changes no maximum
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v));
  }
  const float amax = _mm512_reduce_max_ps(vmax);
  const float scale = unordered ? NAN : std::max(amax / 127.f, 1e-12f);
  const __m512 s = _mm512_set1_ps(scale), lo = _mm512_set1_ps(-128.f), hi = _mm512_set1_ps(127.f);
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 mask = K - k >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (K - k)) - 1u);
    const __m512 q = _mm512_roundscale_ps(_mm512_div_ps(_mm512_maskz_loadu_ps(mask, x + k), s),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    // clamped to [-128, 127]; a NaN quotient to 0
    const __m512 c = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(q, q, _CMP_ORD_Q), _mm512_min_ps(_mm512_max_ps(q, lo), hi));
    const __m512i shifted = _mm512_add_epi32(_mm512_cvtps_epi32(c), _mm512_set1_epi32(128));  // 0..255
    _mm_mask_storeu_epi8(u + k, mask, _mm512_cvtepi32_epi8(shifted));
  }
  return scale;
}

// acc int32 [M, N] = (u - 128) @ w.T for M = 1..kMaxRows shifted rows u, the outputs split across the threads
template <int... MR>
void run_rows(std::integer_sequence<int, MR...>, int64_t M, const int8_t* w, const uint8_t* u, const int32_t* sums,
              int32_t* acc, int64_t N, int64_t K) {
  using Rows = void (*)(const int8_t*, const uint8_t*, const int32_t*, int32_t*, int64_t, int64_t, int64_t, int64_t);
  static constexpr Rows kRows[] = {rows_vnni<MR + 1>...};
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) { kRows[M - 1](w, u, sums, acc, begin, end, N, K); });
}
#endif

// Checks a [M, K] (int8 or float32) against w int8 [N, K] row-major and w_sums int32 [N]
void check_gemv(const at::Tensor& a, const at::Tensor& w, const at::Tensor& w_sums, const char* what) {
  TORCH_CHECK_VALUE(a.dim() == 2 && w.dim() == 2 && w.scalar_type() == at::kChar && a.size(1) == w.size(1), what,
                    ": a [M, K] and w int8 [N, K]; got ", a.sizes(), " and ", w.sizes());
  const int64_t M = a.size(0), K = a.size(1), N = w.size(0);
  TORCH_CHECK_VALUE(M >= 1 && M <= kMaxRows && K >= 1 && K <= kMaxColumns, what, ": 1 to ", kMaxRows,
                    " rows of 1 to ", kMaxColumns, " columns; got ", a.sizes());
  TORCH_CHECK_VALUE(w_sums.scalar_type() == at::kInt && w_sums.numel() == N && w_sums.is_contiguous(), what,
                    ": w_sums int32 [N]; got ", w_sums.sizes());
  TORCH_CHECK(w.is_contiguous(), "w: contiguous [N, K]");
  TORCH_CHECK(cpu_has_vnni(), what, ": this CPU lacks AVX-512 VNNI");
}

// a int8 [M, K], w int8 [N, K] row-major, w_sums int32 [N] (each row's sum) -> int32 [M, N] = a @ w.T
at::Tensor int8_gemv(const at::Tensor& a, const at::Tensor& w, const at::Tensor& w_sums) {
  TORCH_CHECK_VALUE(a.scalar_type() == at::kChar, "int8 gemv: a int8 [M, K]; got ", a.scalar_type());
  check_gemv(a, w, w_sums, "int8 gemv");
  const int64_t M = a.size(0), K = a.size(1), N = w.size(0);
  const at::Tensor ac = a.contiguous();
  at::Tensor u = at::empty({M, K}, a.options().dtype(at::kByte));
  const int8_t* ap = ac.data_ptr<int8_t>();
  uint8_t* up = u.data_ptr<uint8_t>();
  for (int64_t i = 0; i < M * K; ++i) up[i] = static_cast<uint8_t>(ap[i] + 128);
  at::Tensor acc = at::empty({M, N}, a.options().dtype(at::kInt));
#if defined(__x86_64__)
  run_rows(std::make_integer_sequence<int, kMaxRows>(), M, w.data_ptr<int8_t>(), up, w_sums.data_ptr<int32_t>(),
           acc.data_ptr<int32_t>(), N, K);
#endif
  return acc;
}

// A dynamic W8A8 linear at a few rows in one call, the bits of w8a8.int8_linear's PyTorch code: per
// row m of x float32 [M, K], sx = max(max_k |x[m, k]| / 127, 1e-12) (a NaN stays NaN) and
// q = clamp(round(x / sx), -128, 127) (to nearest even), then y [M, N] = ((float) (q @ w.T) * sx) * sw (+ b):
// the quantization, the product and the rescaling without the ~10 ATen calls between them.
at::Tensor int8_linear_dynamic(const at::Tensor& x_in, const at::Tensor& w, const at::Tensor& w_sums,
                               const at::Tensor& w_scale, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK_VALUE(x_in.scalar_type() == at::kFloat, "int8 linear: x float32 [M, K]; got ", x_in.scalar_type());
  check_gemv(x_in, w, w_sums, "int8 linear");
  const int64_t M = x_in.size(0), K = x_in.size(1), N = w.size(0);
  TORCH_CHECK_VALUE(w_scale.scalar_type() == at::kFloat && w_scale.numel() == N && w_scale.is_contiguous(),
                    "int8 linear: weight scale float32 [N]; got ", w_scale.sizes());
  const bool biased = bias.has_value() && bias->defined();
  TORCH_CHECK_VALUE(!biased || (bias->scalar_type() == at::kFloat && bias->numel() == N && bias->is_contiguous()),
                    "int8 linear: bias float32 [N]");
  const at::Tensor x = x_in.contiguous();
  at::Tensor u = at::empty({M, K}, x.options().dtype(at::kByte));
  at::Tensor sx = at::empty({M}, x.options());
  const float* xp = x.data_ptr<float>();
  uint8_t* up = u.data_ptr<uint8_t>();
  float* sp = sx.data_ptr<float>();
#if defined(__x86_64__)
  for (int64_t m = 0; m < M; ++m) sp[m] = quantize_row_shifted(xp + m * K, K, up + m * K);
#endif
  at::Tensor y = at::empty({M, N}, x.options()), products = at::empty({M, N}, x.options().dtype(at::kInt));
#if defined(__x86_64__)
  float* yp = y.data_ptr<float>();
  const int32_t* acc = products.data_ptr<int32_t>();
  run_rows(std::make_integer_sequence<int, kMaxRows>(), M, w.data_ptr<int8_t>(), up, w_sums.data_ptr<int32_t>(),
           products.data_ptr<int32_t>(), N, K);
  // rescaled in a pass of its own: in the GEMV's loop it slowed the 262,144-row head's stream (~5%)
  const float* sw = w_scale.data_ptr<float>();
  const float* b = biased ? bias->data_ptr<float>() : nullptr;
  at::parallel_for(0, N, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = begin; n < end; ++n) {
        const float v = (static_cast<float>(acc[m * N + n]) * sp[m]) * sw[n];  // torch.mul(acc, sx).mul_(sw)
        yp[m * N + n] = b != nullptr ? v + b[n] : v;                             // .add_(bias)
      }
  });
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY(optkit_int8_gemv, m) {
  m.def("gemv(Tensor a, Tensor w, Tensor w_sums) -> Tensor", &int8_gemv);
  m.def("linear_dynamic(Tensor x, Tensor w, Tensor w_sums, Tensor w_scale, Tensor? bias) -> Tensor",
        &int8_linear_dynamic);
  m.def("has_vnni() -> bool", &cpu_has_vnni);
  m.def("max_rows() -> int", []() -> int64_t { return kMaxRows; });
  m.def("max_columns() -> int", []() -> int64_t { return kMaxColumns; });
}
