// bf16 x bf16 linear layers on AVX2 CPUs without a bf16 dot-product instruction (AMD Zen 3, Intel
// before Cooper Lake), where oneDNN has no bf16 path and ATen's bf16 GEMM is slower than fp32's
// (kernels/cpu_bf16_gemv.py says where it runs). Built at first use by cpu_bf16_gemv.py.
//
// y [M, N] = x [M, K] @ w [N, K]^T (+ b), every product exact in fp32 (bf16 is fp32's upper 16 bits),
// summed in fp32 with FMA and rounded once to bf16 (nearest even): what oneDNN's bf16 inner product
// computes, in another order of the sums.
//
// Widening: a bf16 value b is the fp32 whose bits are b << 16. _mm256_unpacklo_epi16(0, w) does that
// for 4 of every 8 of 16 loaded values in one instruction, in an order of its own: of columns 0..15
// (lane 0: 0..7, lane 1: 8..15) unpacklo gives columns {0-3, 8-11} and unpackhi {4-7, 12-15}. The
// activations, widened once a call, are stored in that order (`permuted`), so each FMA pairs the
// same columns. Columns past the last 16 are summed one at a time.
//
// Each step reads 16 columns of kRows weight rows and multiplies them into MR activation rows held in
// L1: kRows x MR accumulators (12 ymm at 4 x 3). M rows go in passes of MR over a block of weight rows
// small enough to stay in L2, so a prefill reads the weight from memory once.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu_isa.h"

namespace {

constexpr int64_t kColumns = 16;        // columns a step widens from one 256-bit load of bf16
constexpr int kRows = 4;                // weight rows a step reads
constexpr int kMaxPassRows = 3;         // activation rows a pass multiplies (kRows x 3 = 12 accumulators)
constexpr int64_t kL2Bytes = 128 << 10;  // the weight block each pass of activation rows re-reads

// x bf16 [K] -> fp32, the first K - K % 16 columns in the unpack order above, the rest as they are
void widen_permuted(const c10::BFloat16* x, int64_t K, float* out) {
  const int64_t full = K - K % kColumns;
  for (int64_t c = 0; c < full; c += kColumns)
    for (int i = 0; i < 4; ++i) {
      out[c + i] = static_cast<float>(x[c + i]);           // unpacklo, lane 0
      out[c + 4 + i] = static_cast<float>(x[c + 8 + i]);   // unpacklo, lane 1
      out[c + 8 + i] = static_cast<float>(x[c + 4 + i]);   // unpackhi, lane 0
      out[c + 12 + i] = static_cast<float>(x[c + 12 + i]);  // unpackhi, lane 1
    }
  for (int64_t c = full; c < K; ++c) out[c] = static_cast<float>(x[c]);
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// Rows [n, n + NR) of w against MR activation rows xw (widened, permuted; row stride K): the fp32 sums
// into sums[m * NR + r]
template <int NR, int MR>
__attribute__((target("avx2,fma"))) void rows_avx2(const uint16_t* w, const float* xw, int64_t n, int64_t K,
                                                   float* sums) {
  const int64_t full = K - K % kColumns;
  __m256 acc[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = _mm256_setzero_ps();
  const __m256i zero = _mm256_setzero_si256();
  for (int64_t c = 0; c < full; c += kColumns) {
    for (int r = 0; r < NR; ++r) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (n + r) * K + c));
      const __m256 lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, raw));
      const __m256 hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, raw));
      for (int m = 0; m < MR; ++m) {
        acc[r][m] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xw + m * K + c), acc[r][m]);
        acc[r][m] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xw + m * K + c + 8), acc[r][m]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) {
      float s = hsum(acc[r][m]);
      const uint16_t* wr = w + (n + r) * K;
      for (int64_t c = full; c < K; ++c) s += c10::detail::f32_from_bits(wr[c]) * xw[m * K + c];
      sums[m * NR + r] = s;
    }
}

// Rows [n_begin, n_end) of w against rows [m0, m0 + MR) of x, into y bf16 (+ bias)
template <int MR>
void pass_avx2(const uint16_t* w, const float* xw, const float* bias, c10::BFloat16* y, int64_t m0, int64_t n_begin,
               int64_t n_end, int64_t N, int64_t K) {
  float sums[kRows * kMaxPassRows];
  auto store = [&](int64_t n, int nr) {
    for (int m = 0; m < MR; ++m)
      for (int r = 0; r < nr; ++r) {
        const float s = sums[m * nr + r];
        y[(m0 + m) * N + n + r] = c10::BFloat16(bias != nullptr ? s + bias[n + r] : s);
      }
  };
  int64_t n = n_begin;
  for (; n + kRows <= n_end; n += kRows) {
    rows_avx2<kRows, MR>(w, xw + m0 * K, n, K, sums);
    store(n, kRows);
  }
  for (; n < n_end; ++n) {
    rows_avx2<1, MR>(w, xw + m0 * K, n, K, sums);
    store(n, 1);
  }
}

// The last rows < kMaxPassRows of a pass over rows [n_begin, n_end), `rest` of them from row m0
template <int MR = kMaxPassRows - 1>
void pass_rest(int64_t rest, const uint16_t* w, const float* xw, const float* bias, c10::BFloat16* y, int64_t m0,
               int64_t n_begin, int64_t n_end, int64_t N, int64_t K) {
  if constexpr (MR > 0) {
    if (rest == MR) return pass_avx2<MR>(w, xw, bias, y, m0, n_begin, n_end, N, K);
    pass_rest<MR - 1>(rest, w, xw, bias, y, m0, n_begin, n_end, N, K);
  }
}
#endif

// x bf16 [M, K], w bf16 [N, K] row-major, bias bf16 [N] or none -> y bf16 [M, N]
at::Tensor bf16_linear(const at::Tensor& x_in, const at::Tensor& w, const c10::optional<at::Tensor>& bias_in) {
  TORCH_CHECK_VALUE(x_in.dim() == 2 && w.dim() == 2 && x_in.size(1) == w.size(1) && x_in.size(0) >= 1 &&
                        w.size(0) >= 1 && w.size(1) >= 1,
                    "bf16 linear: x [M, K] and w [N, K]; got ", x_in.sizes(), " and ", w.sizes());
  TORCH_CHECK_VALUE(x_in.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16,
                    "bf16 linear: x and w bfloat16; got ", x_in.scalar_type(), " and ", w.scalar_type());
  TORCH_CHECK(w.is_contiguous() && w.device().is_cpu() && x_in.device().is_cpu(), "bf16 linear: CPU tensors, w contiguous");
  TORCH_CHECK(cpu_isa::has_avx2_fma(), "bf16 linear: this CPU has no AVX2 with FMA");
  const int64_t M = x_in.size(0), K = x_in.size(1), N = w.size(0);
  at::Tensor bias_f;
  const float* bias = nullptr;
  if (bias_in.has_value() && bias_in->defined()) {
    TORCH_CHECK_VALUE(bias_in->numel() == N, "bf16 linear: bias [N]; got ", bias_in->sizes(), " for N ", N);
    bias_f = bias_in->to(at::kFloat).contiguous();
    bias = bias_f.data_ptr<float>();
  }
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
#if defined(__x86_64__)
  std::vector<float> xw(M * K);
  for (int64_t m = 0; m < M; ++m) widen_permuted(x.data_ptr<c10::BFloat16>() + m * K, K, xw.data() + m * K);
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<c10::BFloat16>());
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  // weight rows per L2 block (a multiple of kRows), and per task at least one block
  const int64_t block = std::max<int64_t>(kRows, kL2Bytes / (2 * K) / kRows * kRows);
  at::parallel_for(0, N, block, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; b += block) {
      const int64_t b_end = std::min(end, b + block);
      int64_t m = 0;
      for (; m + kMaxPassRows <= M; m += kMaxPassRows) pass_avx2<kMaxPassRows>(wp, xw.data(), bias, yp, m, b, b_end, N, K);
      pass_rest(M - m, wp, xw.data(), bias, yp, m, b, b_end, N, K);
    }
  });
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY(optkit_bf16_gemv, m) {
  m.def("linear(Tensor x, Tensor w, Tensor? bias) -> Tensor", &bf16_linear);
  m.def("has_avx2_fma() -> bool", &cpu_isa::has_avx2_fma);
}
