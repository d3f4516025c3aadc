// int8 x int8 -> int32 matrix products for a few rows (decode), on AVX-512 VNNI or AVX2 CPUs: the
// exact integer result torch._int_mm computes, read straight from the weight's row-major [N, K]
// storage; and a dynamic W8A8 linear around it (quantization, product, rescaling) in one call.
// Built at first use by optkit/kernels/cpu_int8_gemv.py, which documents when it runs.
//
// AVX-512 VNNI: vpdpbusd multiplies unsigned bytes by signed bytes, so the activations go in shifted,
// u = a + 128 (0..255), and the shift comes out with each output's weight sum:
//   acc[m, n] = sum_k a[m, k] w[n, k] = sum_k u[m, k] w[n, k] - 128 * sum_k w[n, k]
// exact in int32 for K < 2^31 / (255 * 128) = 65,793 columns (|u w| <= 255 * 128).
// AVX2: no byte product sums exactly in 16 bits (vpmaddubsw saturates its pairs), so the weights are
// widened to int16 (vpmovsxbw) and vpmaddwd multiplies them by the int16 activations, adding pairs into
// int32: |a w| <= 2^14, and K <= 65,792 columns sum to at most 2^14 * K < 2^31.
// Each output row n is read once and serves up to kMaxRows activation rows m (in registers): with VNNI
// the operators take at most that many (past it oneDNN's GEMM is faster); on AVX2 any number, in passes
// of kMaxRows (there oneDNN's int8 GEMM has no VNNI and is 18-44x slower from 4 to 256 rows).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>

#include "cpu_isa.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

// Activation rows one pass over the weight takes, and with VNNI one call: past 8 the activation loads
// bound it and oneDNN's VNNI GEMM is faster (bench/cpu_int8_gemv.py: 1.2-1.7x _int_mm at 8 rows, 0.5-0.9x
// at 16).
constexpr int64_t kMaxRows = 8;
constexpr int64_t kMaxRowsAvx2 = std::numeric_limits<int32_t>::max();  // every prefill chunk
constexpr int64_t kMaxColumns = 65792;  // K above which the int32 sum of shifted products could overflow
// How far ahead of its loads a thread asks for the weight rows (bytes), as cpu_w4a8.cpp's kernel: the
// hardware prefetcher alone falls short of the memory's bandwidth (bench/cpu_prefetch.py)
constexpr int kPrefetchBytes = 4096;

// Each operator takes the instruction set to run (cpu_int8_gemv.py's selected_isa: the best, or AVX2
// where OPTKIT_CPU_ISA=avx2 caps it)
using cpu_isa::kAvx2;
using cpu_isa::kAvx512Vnni;

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

// x [16] int16 times the 16 int8 weights at w, in pairs into 8 int32 lanes (the weights widened)
__attribute__((target("avx2"))) inline __m256i products16(const int8_t* w, const int16_t* x) {
  return _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))),
                           _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
}

// Rows n of w [N, K] against MR int16 activation rows x [MR, K], 64 columns a step: four 16-column
// products summed in a tree before they join the row's accumulator (one dependent add a step), the
// weights widened to int16 and multiplied in pairs into int32 (exact, see the top); then the last
// K % 64 columns 16 at a time, and the last K % 16 in scalar code.
template <int MR>
__attribute__((target("avx2"))) void rows_avx2(const int8_t* w, const int16_t* x, int32_t* acc, int64_t n_begin,
                                               int64_t n_end, int64_t N, int64_t K) {
  const int64_t blocks = K / 64, full = K / 16;
  for (int64_t n = n_begin; n < n_end; ++n) {
    const int8_t* wn = w + n * K;
    __m256i s[MR];
    for (int r = 0; r < MR; ++r) s[r] = _mm256_setzero_si256();
    for (int64_t c = 0; c < 64 * blocks; c += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(wn + c + kPrefetchBytes), _MM_HINT_T0);
      for (int r = 0; r < MR; ++r) {
        const int16_t* xr = x + r * K + c;
        const __m256i low = _mm256_add_epi32(products16(wn + c, xr), products16(wn + c + 16, xr + 16));
        const __m256i high = _mm256_add_epi32(products16(wn + c + 32, xr + 32), products16(wn + c + 48, xr + 48));
        s[r] = _mm256_add_epi32(s[r], _mm256_add_epi32(low, high));
      }
    }
    for (int64_t c = 64 * blocks; c < 16 * full; c += 16)
      for (int r = 0; r < MR; ++r) s[r] = _mm256_add_epi32(s[r], products16(wn + c, x + r * K + c));
    for (int r = 0; r < MR; ++r) {
      __m128i v = _mm_add_epi32(_mm256_castsi256_si128(s[r]), _mm256_extracti128_si256(s[r], 1));
      v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0x4E));  // lanes 0+2, 1+3
      v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0xB1));  // + the neighbour: every lane the sum
      int32_t total = _mm_cvtsi128_si32(v);
      for (int64_t k = 16 * full; k < K; ++k) total += static_cast<int32_t>(x[r * K + k]) * wn[k];
      acc[r * N + n] = total;
    }
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

// acc int32 [M, N] = x @ w.T for M = 1..kMaxRows int16 rows x, the outputs split across the threads
template <int... MR>
void run_rows_avx2(std::integer_sequence<int, MR...>, int64_t M, const int8_t* w, const int16_t* x, int32_t* acc,
                   int64_t N, int64_t K) {
  using Rows = void (*)(const int8_t*, const int16_t*, int32_t*, int64_t, int64_t, int64_t, int64_t);
  static constexpr Rows kRows[] = {rows_avx2<MR + 1>...};
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) { kRows[M - 1](w, x, acc, begin, end, N, K); });
}
#endif

// One row of x [K] quantized as w8a8.quantize_activations does it (quantize_row_shifted's numbers,
// the AVX2 product's int16 activations, not shifted); its scale returned. Plain C++: K is a row's width.
float quantize_row_int16(const float* x, int64_t K, int16_t* q) {
  float amax = 0.f;
  bool unordered = false;
  for (int64_t k = 0; k < K; ++k) {
    unordered |= std::isnan(x[k]);
    amax = std::max(amax, std::fabs(x[k]));
  }
  const float scale = unordered ? NAN : std::max(amax / 127.f, 1e-12f);
  for (int64_t k = 0; k < K; ++k) {
    const float r = std::nearbyint(x[k] / scale);  // to nearest even, as torch.round
    q[k] = std::isnan(r) ? 0 : static_cast<int16_t>(std::min(std::max(r, -128.f), 127.f));
  }
  return scale;
}

// The products of M int8 rows a [M, K] (as shifted u = a + 128 for VNNI, as int16 x for AVX2, the other
// null) with w [N, K] into acc int32 [M, N] on `isa`
void products(int64_t isa, int64_t M, const at::Tensor& w, const at::Tensor& w_sums, const uint8_t* u,
              const int16_t* x, int32_t* acc, int64_t N, int64_t K) {
#if defined(__x86_64__)
  if (isa == kAvx512Vnni)
    run_rows(std::make_integer_sequence<int, kMaxRows>(), M, w.data_ptr<int8_t>(), u, w_sums.data_ptr<int32_t>(), acc,
             N, K);
  else
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows)  // each pass reads the weight once for up to kMaxRows rows
      run_rows_avx2(std::make_integer_sequence<int, kMaxRows>(), std::min(kMaxRows, M - m0), w.data_ptr<int8_t>(),
                    x + m0 * K, acc + m0 * N, N, K);
#endif
}

// The most rows one call takes on `isa`
int64_t max_rows(int64_t isa) { return isa == kAvx512Vnni ? kMaxRows : kMaxRowsAvx2; }

// Checks a [M, K] (int8 or float32) against w int8 [N, K] row-major and w_sums int32 [N]
void check_gemv(const at::Tensor& a, const at::Tensor& w, const at::Tensor& w_sums, int64_t isa, const char* what) {
  TORCH_CHECK_VALUE(a.dim() == 2 && w.dim() == 2 && w.scalar_type() == at::kChar && a.size(1) == w.size(1), what,
                    ": a [M, K] and w int8 [N, K]; got ", a.sizes(), " and ", w.sizes());
  const int64_t M = a.size(0), K = a.size(1), N = w.size(0);
  TORCH_CHECK_VALUE(M >= 1 && M <= max_rows(isa) && K >= 1 && K <= kMaxColumns, what, ": 1 to ", max_rows(isa),
                    " rows of 1 to ", kMaxColumns, " columns; got ", a.sizes());
  TORCH_CHECK_VALUE(w_sums.scalar_type() == at::kInt && w_sums.numel() == N && w_sums.is_contiguous(), what,
                    ": w_sums int32 [N]; got ", w_sums.sizes());
  TORCH_CHECK(w.is_contiguous(), "w: contiguous [N, K]");
  static const int64_t best = cpu_isa::best();
  TORCH_CHECK(isa >= kAvx2 && isa <= best, what, ": instruction set ", isa, " (1 AVX2, 2 AVX-512 VNNI) not on this "
              "CPU, whose best is ", best);
}

// a int8 [M, K], w int8 [N, K] row-major, w_sums int32 [N] (each row's sum) -> int32 [M, N] = a @ w.T
at::Tensor int8_gemv(const at::Tensor& a, const at::Tensor& w, const at::Tensor& w_sums, int64_t isa) {
  TORCH_CHECK_VALUE(a.scalar_type() == at::kChar, "int8 gemv: a int8 [M, K]; got ", a.scalar_type());
  check_gemv(a, w, w_sums, isa, "int8 gemv");
  const int64_t M = a.size(0), K = a.size(1), N = w.size(0);
  const at::Tensor ac = a.contiguous();
  const int8_t* ap = ac.data_ptr<int8_t>();
  at::Tensor acc = at::empty({M, N}, a.options().dtype(at::kInt));
  if (isa == kAvx512Vnni) {
    at::Tensor u = at::empty({M, K}, a.options().dtype(at::kByte));
    uint8_t* up = u.data_ptr<uint8_t>();
    for (int64_t i = 0; i < M * K; ++i) up[i] = static_cast<uint8_t>(ap[i] + 128);
    products(isa, M, w, w_sums, up, nullptr, acc.data_ptr<int32_t>(), N, K);
  } else {
    at::Tensor x = at::empty({M, K}, a.options().dtype(at::kShort));
    int16_t* xp = x.data_ptr<int16_t>();
    for (int64_t i = 0; i < M * K; ++i) xp[i] = ap[i];
    products(isa, M, w, w_sums, nullptr, xp, acc.data_ptr<int32_t>(), N, K);
  }
  return acc;
}

// A dynamic W8A8 linear at a few rows in one call, the bits of w8a8.int8_linear's PyTorch code: per
// row m of x float32 [M, K], sx = max(max_k |x[m, k]| / 127, 1e-12) (a NaN stays NaN) and
// q = clamp(round(x / sx), -128, 127) (to nearest even), then y [M, N] = ((float) (q @ w.T) * sx) * sw (+ b):
// the quantization, the product and the rescaling without the ~10 ATen calls between them.
at::Tensor int8_linear_dynamic(const at::Tensor& x_in, const at::Tensor& w, const at::Tensor& w_sums,
                               const at::Tensor& w_scale, const c10::optional<at::Tensor>& bias, int64_t isa) {
  TORCH_CHECK_VALUE(x_in.scalar_type() == at::kFloat, "int8 linear: x float32 [M, K]; got ", x_in.scalar_type());
  check_gemv(x_in, w, w_sums, isa, "int8 linear");
  const int64_t M = x_in.size(0), K = x_in.size(1), N = w.size(0);
  TORCH_CHECK_VALUE(w_scale.scalar_type() == at::kFloat && w_scale.numel() == N && w_scale.is_contiguous(),
                    "int8 linear: weight scale float32 [N]; got ", w_scale.sizes());
  const bool biased = bias.has_value() && bias->defined();
  TORCH_CHECK_VALUE(!biased || (bias->scalar_type() == at::kFloat && bias->numel() == N && bias->is_contiguous()),
                    "int8 linear: bias float32 [N]");
  const at::Tensor x = x_in.contiguous();
  at::Tensor sx = at::empty({M}, x.options());
  const float* xp = x.data_ptr<float>();
  float* sp = sx.data_ptr<float>();
  at::Tensor products_int32 = at::empty({M, N}, x.options().dtype(at::kInt));
  int32_t* acc = products_int32.data_ptr<int32_t>();
  if (isa == kAvx512Vnni) {
    at::Tensor u = at::empty({M, K}, x.options().dtype(at::kByte));
    uint8_t* up = u.data_ptr<uint8_t>();
#if defined(__x86_64__)
    for (int64_t m = 0; m < M; ++m) sp[m] = quantize_row_shifted(xp + m * K, K, up + m * K);
#endif
    products(isa, M, w, w_sums, up, nullptr, acc, N, K);
  } else {
    at::Tensor q = at::empty({M, K}, x.options().dtype(at::kShort));
    int16_t* qp = q.data_ptr<int16_t>();
    for (int64_t m = 0; m < M; ++m) sp[m] = quantize_row_int16(xp + m * K, K, qp + m * K);
    products(isa, M, w, w_sums, nullptr, qp, acc, N, K);
  }
  at::Tensor y = at::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
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
  return y;
}

}  // namespace

TORCH_LIBRARY(optkit_int8_gemv, m) {
  m.def("gemv(Tensor a, Tensor w, Tensor w_sums, int isa) -> Tensor", &int8_gemv);
  m.def("linear_dynamic(Tensor x, Tensor w, Tensor w_sums, Tensor w_scale, Tensor? bias, int isa) -> Tensor",
        &int8_linear_dynamic);
  m.def("cpu_isa() -> int", &cpu_isa::best);
  m.def("max_rows(int isa) -> int", &max_rows);
  m.def("max_columns() -> int", []() -> int64_t { return kMaxColumns; });
}
