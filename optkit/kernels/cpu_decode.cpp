// The small operators of a CPU decode step, one call each instead of 5-10 ATen operators: RMSNorm,
// RoPE, and attention of one query token per sequence over the paged KV cache, alone or joined to the
// per-head q/k norms, RoPE and the cache write after a fused q|k|v projection, and a 4-bit model's
// whole decoder layer, or all its layers, of a decode step; float32 or bfloat16.
// Built at first use by optkit/kernels/cpu_decode.py (kernels/cpp_build.py), which documents when
// the runtime takes them. At batch 1 a step of a 4-bit model spent as long in these operators'
// dispatch, thread wake-ups and temporaries as in its matmuls (docs/results.md, issue 20).
//
// Numerics follow the PyTorch code they replace (models/llama.py, kernels/paged_attention.py):
// bfloat16 values are computed in float32 and rounded to bfloat16 (to nearest even) wherever a
// PyTorch operator of that code writes a bfloat16 tensor. Compiled with -ffp-contract=off, so a * b + c
// rounds twice as the separate operators do: RoPE gives the same bits as apply_rope.

#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>
#include <ATen/Version.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/embedding.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/silu.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <omp.h>
#include <sched.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <thread>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu_isa.h"
#include "cpu_w4a8_tiles.h"

namespace {

using c10::BFloat16;

inline float as_float(float v) { return v; }
inline float as_float(BFloat16 v) { return static_cast<float>(v); }
template <typename T>
inline T rounded(float v) {  // float32 -> T, as a PyTorch operator writing a T tensor rounds
  return static_cast<T>(v);
}

constexpr int kLanes = 16;  // independent partial sums: the compiler keeps them in vector registers

// sum_i a[i] * b[i] over n values, in float32, in kLanes partial sums, then the tail
template <typename A, typename B>
inline float dot(const A* a, const B* b, int64_t n) {
  float part[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) part[j] += as_float(a[i + j]) * as_float(b[i + j]);
  float sum = 0.f;
  for (int j = 0; j < kLanes; ++j) sum += part[j];
  for (; i < n; ++i) sum += as_float(a[i]) * as_float(b[i]);
  return sum;
}

bool is_float_or_bf16(const at::Tensor& t) {
  return t.device().is_cpu() && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16);
}

// ---- RMSNorm: x [..., K] -> per row n = x / sqrt(mean(x²) + eps) in float32, then
//   float32 x:                      n * weight
//   bfloat16 x, cast_first:         bf16(bf16(n) * weight)        (LlamaRMSNorm: weight * x.to(dtype))
//   bfloat16 x, not cast_first:     bf16(n * (offset + weight))   (Olmo2RMSNorm: (weight * x).to(dtype);
//                                                                  Gemma's offset 1: x * (1 + weight) in float32)
template <typename T, typename W>
void rms_norm_row(const T* xr, const W* w, T* yr, int64_t K, float eps, bool cast_first, float offset) {
  const float inv = 1.f / std::sqrt(dot(xr, xr, K) / static_cast<float>(K) + eps);
  for (int64_t k = 0; k < K; ++k) {
    const float n = as_float(xr[k]) * inv;
    const float scale = offset != 0.f ? offset + as_float(w[k]) : as_float(w[k]);
    yr[k] = cast_first ? rounded<T>(as_float(rounded<T>(n)) * scale) : rounded<T>(n * scale);
  }
}

template <typename T, typename W>
void rms_norm_rows(const T* x, const W* w, T* y, int64_t M, int64_t K, float eps, bool cast_first, float offset) {
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) rms_norm_row(x + m * K, w, y + m * K, K, eps, cast_first, offset);
  });
}

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight, double eps, bool cast_first, double offset) {
  TORCH_CHECK(is_float_or_bf16(x_in) && is_float_or_bf16(weight), "x, weight: float32 or bfloat16 CPU tensors");
  const int64_t K = weight.numel();
  // shapes come from the model: a wrong one raises ValueError (the Python wrapper's user error), never
  // reaches M = numel / K with K = 0
  TORCH_CHECK_VALUE(weight.dim() == 1 && K >= 1 && x_in.dim() >= 1 && x_in.size(-1) == K,
                    "rms_norm: weight [K] with K >= 1 and x [..., K]; got weight ", weight.sizes(), ", x ", x_in.sizes());
  TORCH_CHECK(weight.is_contiguous(), "weight: contiguous");
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty_like(x);
  const int64_t M = x.numel() / K;
  const float e = static_cast<float>(eps), o = static_cast<float>(offset);
  const bool first = cast_first && x.scalar_type() == at::kBFloat16;
  if (x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat)
    rms_norm_rows(x.data_ptr<float>(), weight.data_ptr<float>(), y.data_ptr<float>(), M, K, e, false, o);
  else if (x.scalar_type() == at::kFloat)
    rms_norm_rows(x.data_ptr<float>(), weight.data_ptr<BFloat16>(), y.data_ptr<float>(), M, K, e, false, o);
  else if (weight.scalar_type() == at::kFloat)
    rms_norm_rows(x.data_ptr<BFloat16>(), weight.data_ptr<float>(), y.data_ptr<BFloat16>(), M, K, e, first, o);
  else
    rms_norm_rows(x.data_ptr<BFloat16>(), weight.data_ptr<BFloat16>(), y.data_ptr<BFloat16>(), M, K, e, first, o);
  return y;
}

// ---- RoPE: x [T, H, D] (rows at any stride, heads and dims contiguous), cos and signed sin
// [T, 1, R] (R even, R <= D; rope_cos_sin's) -> contiguous [T, H, D]: over the first R dims of each head
//   y[i] = x[i] * cos[i] + x[(i + R/2) mod R] * sin[i]
// (HF Llama's rotate_half with its signs folded into sin; each product and the sum rounded to T), the
// other D - R dims copied.
template <typename T>
void rope_head(const T* xr, const T* c, const T* s, T* yr, int64_t D, int64_t R) {
  const int64_t half = R / 2;
  for (int64_t i = 0; i < R; ++i) {
    const T turned = xr[i < half ? i + half : i - half];
    const T a = rounded<T>(as_float(xr[i]) * as_float(c[i])), b = rounded<T>(as_float(turned) * as_float(s[i]));
    yr[i] = rounded<T>(as_float(a) + as_float(b));
  }
  for (int64_t i = R; i < D; ++i) yr[i] = xr[i];
}

template <typename T>
void rope_rows(const T* x, const T* cos, const T* sin, T* y, int64_t T_, int64_t H, int64_t D, int64_t R,
               int64_t row_stride) {
  at::parallel_for(0, T_, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < H; ++h) rope_head(x + t * row_stride + h * D, cos + t * R, sin + t * R, y + (t * H + h) * D, D, R);
  });
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(is_float_or_bf16(x) && cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "x, cos, sin: float32 or bfloat16 CPU tensors of one dtype");
  TORCH_CHECK_VALUE(x.dim() == 3 && cos.dim() >= 1 && sin.dim() >= 1, "rope: x [T, H, D], cos and sin [T, 1, R]; got x ",
                    x.sizes(), ", cos ", cos.sizes());
  TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == x.size(2), "x: [T, H, D], heads contiguous");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), R = cos.size(-1);
  TORCH_CHECK_VALUE(cos.numel() == T * R && sin.numel() == T * R, "rope: cos, sin: [T, 1, R]; got cos ", cos.sizes(),
                    ", sin ", sin.sizes(), " for x ", x.sizes());
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous(), "cos, sin: contiguous");
  TORCH_CHECK_VALUE(R % 2 == 0 && R <= D, "rope: ", R, " rotary dims: even and at most the head dim ", D);
  at::Tensor y = at::empty({T, H, D}, x.options());
  if (x.scalar_type() == at::kFloat)
    rope_rows(x.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), y.data_ptr<float>(), T, H, D, R,
              x.stride(0));
  else
    rope_rows(x.data_ptr<BFloat16>(), cos.data_ptr<BFloat16>(), sin.data_ptr<BFloat16>(), y.data_ptr<BFloat16>(), T,
              H, D, R, x.stride(0));
  return y;
}

// ---- Decode attention. One query head over keys first..n-1 of its sequence: scores (n - first
// floats of scratch), then out [D] = sum_t softmax(scores)_t v_t, in float32. k and v point at the
// head's vector in slot 0; slot s's is `slot_stride` values on. The blocks of the table are walked in
// order (no division per key). Dot products and the weighted sums of V through Vec (AVX-512, AVX2 or portable).
template <class Vec, typename T>
void attend_head(const float* q, const T* k, const T* v, const int64_t* table, int64_t first, int64_t n,
                 int64_t block_size, int64_t slot_stride, int64_t D, float scale, float* scores, float* out) {
  float top = -INFINITY;
  for (int64_t j = first / block_size; j * block_size < n; ++j) {
    const int64_t start = std::max(j * block_size, first), stop = std::min((j + 1) * block_size, n);
    const T* kb = k + (table[j] * block_size - j * block_size) * slot_stride;  // + t * slot_stride: key t
    for (int64_t t = start; t < stop; ++t) {
      const float s = Vec::dot(q, kb + t * slot_stride, D) * scale;
      scores[t - first] = s;
      top = std::max(top, s);
    }
  }
  const float total = Vec::exp_and_sum(scores, n - first, top);  // scores[t] = e^(scores[t] - top)
  std::fill(out, out + D, 0.f);
  for (int64_t j = first / block_size; j * block_size < n; ++j) {
    const int64_t start = std::max(j * block_size, first), stop = std::min((j + 1) * block_size, n);
    const T* vb = v + (table[j] * block_size - j * block_size) * slot_stride;
    for (int64_t t = start; t < stop; ++t) Vec::axpy(scores[t - first], vb + t * slot_stride, out, D);
  }
  const float inv = 1.f / total;
  for (int64_t i = 0; i < D; ++i) out[i] *= inv;
}

struct Portable {
  template <typename T>
  static float dot(const float* a, const T* b, int64_t n) {
    return ::dot(a, b, n);
  }
  template <typename T>
  static void axpy(float p, const T* x, float* y, int64_t n) {  // y += p x
    for (int64_t i = 0; i < n; ++i) y[i] += p * as_float(x[i]);
  }
  static float exp_and_sum(float* s, int64_t n, float top) {  // s[t] = e^(s[t] - top); their sum
    float total = 0.f;
    for (int64_t t = 0; t < n; ++t) {
      s[t] = std::exp(s[t] - top);
      total += s[t];
    }
    return total;
  }
};

#if defined(__x86_64__)
#define OPTKIT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

struct Avx512 {
  // 16 values from p (the first `count`, zeros after), as float32: a bfloat16 is a float32's top 16 bits
  OPTKIT_AVX512 static __m512 load(const float* p, int64_t count) {
    return count >= 16 ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << count) - 1u), p);
  }
  OPTKIT_AVX512 static __m512 load(const BFloat16* p, int64_t count) {
    const __m256i bits = count >= 16 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                                     : _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << count) - 1u), p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
  template <typename T>
  OPTKIT_AVX512 static float dot(const float* a, const T* b, int64_t n) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) acc = _mm512_fmadd_ps(load(a + i, n - i), load(b + i, n - i), acc);
    return _mm512_reduce_add_ps(acc);
  }
  // e^x for x <= 0 (a score minus the maximum), 16 at a time: e^x = 2^k · e^r with k = round(x / ln 2) and
  // r = x - k ln 2 in [-ln 2 / 2, ln 2 / 2] (Cody and Waite: ln 2 in two parts, so r is exact to float32),
  // e^r by its Taylor polynomial of degree 6 (remainder below r^7 / 7! < 1.3e-7 relative: within an ulp
  // or two of std::exp), 2^k applied by vscalefps (which underflows to 0 as e^x does, below -103).
  OPTKIT_AVX512 static __m512 exp_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));  // e^-104 is 0 in float32; keeps k finite
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145751953125f), x);  // ln 2's high part: 16 bits
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.428606765330187e-06f), r);     // and the rest
    __m512 p = _mm512_set1_ps(1.f / 720.f);
    for (const float c : {1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    return _mm512_scalef_ps(p, k);
  }
  OPTKIT_AVX512 static float exp_and_sum(float* s, int64_t n, float top) {
    const __m512 shift = _mm512_set1_ps(top);
    __m512 total = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t += 16) {
      const __mmask16 mask = n - t >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - t)) - 1u);
      const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s + t), shift));
      _mm512_mask_storeu_ps(s + t, mask, e);
      total = _mm512_add_ps(total, _mm512_maskz_mov_ps(mask, e));
    }
    return _mm512_reduce_add_ps(total);
  }
  template <typename T>
  OPTKIT_AVX512 static void axpy(float p, const T* x, float* y, int64_t n) {
    const __m512 pv = _mm512_set1_ps(p);
    for (int64_t i = 0; i < n; i += 16) {
      const __m512 sum = _mm512_fmadd_ps(pv, load(x + i, n - i), load(y + i, n - i));
      if (n - i >= 16)
        _mm512_storeu_ps(y + i, sum);
      else
        _mm512_mask_storeu_ps(y + i, static_cast<__mmask16>((1u << (n - i)) - 1u), sum);
    }
  }
};

// attend_head with Avx512's operations inlined: `flatten` inlines every call into this function,
// whose target admits them.
template <typename T>
OPTKIT_AVX512 __attribute__((flatten)) void attend_head_avx512_any(const float* q, const T* k, const T* v,
                                                                    const int64_t* table, int64_t first, int64_t n,
                                                                    int64_t block_size, int64_t slot_stride, int64_t D,
                                                                    float scale, float* scores, float* out) {
  attend_head<Avx512, T>(q, k, v, table, first, n, block_size, slot_stride, D, scale, scores, out);
}

// attend_head for D = 16 NV, the query and the output's partial sums held in NV registers: the weighted
// sum of V no longer stores and reloads `out` for every key (a chain through memory that bound the
// loop). The same operations in the same order as attend_head<Avx512>, so the same bits.
template <int NV, typename T>
OPTKIT_AVX512 __attribute__((flatten)) void attend_head_avx512_fixed(const float* q, const T* k, const T* v,
                                                                      const int64_t* table, int64_t first, int64_t n,
                                                                      int64_t block_size, int64_t slot_stride,
                                                                      float scale, float* scores, float* out) {
  __m512 qv[NV], acc[NV];
  for (int j = 0; j < NV; ++j) qv[j] = _mm512_loadu_ps(q + 16 * j);
  float top = -INFINITY;
  for (int64_t j = first / block_size; j * block_size < n; ++j) {
    const int64_t start = std::max(j * block_size, first), stop = std::min((j + 1) * block_size, n);
    const T* kb = k + (table[j] * block_size - j * block_size) * slot_stride;
    for (int64_t t = start; t < stop; ++t) {
      __m512 dot = _mm512_setzero_ps();
      for (int i = 0; i < NV; ++i) dot = _mm512_fmadd_ps(qv[i], Avx512::load(kb + t * slot_stride + 16 * i, 16), dot);
      const float s = _mm512_reduce_add_ps(dot) * scale;
      scores[t - first] = s;
      top = std::max(top, s);
    }
  }
  const float total = Avx512::exp_and_sum(scores, n - first, top);
  for (int i = 0; i < NV; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t j = first / block_size; j * block_size < n; ++j) {
    const int64_t start = std::max(j * block_size, first), stop = std::min((j + 1) * block_size, n);
    const T* vb = v + (table[j] * block_size - j * block_size) * slot_stride;
    for (int64_t t = start; t < stop; ++t) {
      const __m512 p = _mm512_set1_ps(scores[t - first]);
      for (int i = 0; i < NV; ++i) acc[i] = _mm512_fmadd_ps(p, Avx512::load(vb + t * slot_stride + 16 * i, 16), acc[i]);
    }
  }
  const __m512 inv = _mm512_set1_ps(1.f / total);
  for (int i = 0; i < NV; ++i) _mm512_storeu_ps(out + 16 * i, _mm512_mul_ps(acc[i], inv));
}

template <typename T>
void attend_head_avx512(const float* q, const T* k, const T* v, const int64_t* table, int64_t first, int64_t n,
                        int64_t block_size, int64_t slot_stride, int64_t D, float scale, float* scores, float* out) {
  switch (D) {  // the head dims of the families: registers for each; any other takes the loops
    case 64: return attend_head_avx512_fixed<4, T>(q, k, v, table, first, n, block_size, slot_stride, scale, scores, out);
    case 128: return attend_head_avx512_fixed<8, T>(q, k, v, table, first, n, block_size, slot_stride, scale, scores, out);
    case 256: return attend_head_avx512_fixed<16, T>(q, k, v, table, first, n, block_size, slot_stride, scale, scores, out);
    default: return attend_head_avx512_any<T>(q, k, v, table, first, n, block_size, slot_stride, D, scale, scores, out);
  }
}
#endif

#if defined(__x86_64__)
#define OPTKIT_AVX2 __attribute__((target("avx2,fma")))

// Avx512's operations 8 lanes wide, for CPUs with AVX2 and FMA but not AVX-512 (AMD Zen 2 and 3): 8 partial
// sums where Avx512 keeps 16, and 2^k by two products where Avx512 scales (bits of their own, as the
// portable loops have theirs; each within float32 rounding of the reference)
struct Avx2 {
  OPTKIT_AVX2 static __m256i first(int64_t count) {  // lanes below `count` set
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(count, 8))),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  // 8 values from p (the first `count`, zeros after), as float32: a bfloat16 is a float32's top 16 bits
  OPTKIT_AVX2 static __m256 load(const float* p, int64_t count) {
    return count >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, first(count));
  }
  OPTKIT_AVX2 static __m256 load(const BFloat16* p, int64_t count) {
    __m128i bits;
    if (count >= 8) {
      bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    } else {
      alignas(16) uint16_t part[8] = {};
      std::memcpy(part, p, count * sizeof(uint16_t));
      bits = _mm_load_si128(reinterpret_cast<const __m128i*>(part));
    }
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
  }
  OPTKIT_AVX2 static float sum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  template <typename T>
  OPTKIT_AVX2 static float dot(const float* a, const T* b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(load(a + i, n - i), load(b + i, n - i), acc);
    return sum(acc);
  }
  // Avx512::exp_nonpositive's e^x, 8 at a time; 2^k (k in [-150, 0]) applied as two factors 2^(k/2)
  // and 2^(k - k/2), each a normal float built from its exponent bits (AVX2 has no vscalefps): the
  // second product rounds to a subnormal where e^x is one.
  OPTKIT_AVX2 static __m256 exp_nonpositive(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-104.f));
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(k, _mm256_set1_ps(1.428606765330187e-06f), r);
    __m256 p = _mm256_set1_ps(1.f / 720.f);
    for (const float c : {1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f}) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    const __m256i ki = _mm256_cvtps_epi32(k), half = _mm256_srai_epi32(ki, 1), rest = _mm256_sub_epi32(ki, half);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 two_half = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
    const __m256 two_rest = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(rest, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, two_half), two_rest);
  }
  OPTKIT_AVX2 static float exp_and_sum(float* s, int64_t n, float top) {
    const __m256 shift = _mm256_set1_ps(top);
    __m256 total = _mm256_setzero_ps();
    for (int64_t t = 0; t < n; t += 8) {
      const __m256i mask = first(n - t);
      const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_maskload_ps(s + t, mask), shift));
      _mm256_maskstore_ps(s + t, mask, e);
      total = _mm256_add_ps(total, _mm256_and_ps(e, _mm256_castsi256_ps(mask)));
    }
    return sum(total);
  }
  template <typename T>
  OPTKIT_AVX2 static void axpy(float p, const T* x, float* y, int64_t n) {
    const __m256 pv = _mm256_set1_ps(p);
    for (int64_t i = 0; i < n; i += 8) {
      const __m256 y_new = _mm256_fmadd_ps(pv, load(x + i, n - i), load(y + i, n - i));
      if (n - i >= 8)
        _mm256_storeu_ps(y + i, y_new);
      else
        _mm256_maskstore_ps(y + i, first(n - i), y_new);
    }
  }
};

// attend_head with Avx2's operations inlined (as attend_head_avx512_any)
template <typename T>
OPTKIT_AVX2 __attribute__((flatten)) void attend_head_avx2_any(const float* q, const T* k, const T* v,
                                                               const int64_t* table, int64_t first, int64_t n,
                                                               int64_t block_size, int64_t slot_stride, int64_t D,
                                                               float scale, float* scores, float* out) {
  attend_head<Avx2, T>(q, k, v, table, first, n, block_size, slot_stride, D, scale, scores, out);
}

// Key t's score: its 8-lane FMA chain over the NV vectors of q, summed as Avx2::dot sums, times scale
template <int NV, typename T>
OPTKIT_AVX2 inline float score_avx2(const float* q, const T* kt, float scale) {
  __m256 dot = _mm256_setzero_ps();
  for (int i = 0; i < NV; ++i) dot = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * i), Avx2::load(kt + 8 * i, 8), dot);
  return Avx2::sum(dot) * scale;
}

// attend_head<Avx2> for D = 8 NV (NV a multiple of 8), the same operations in the same order, so the same
// bits, arranged for AVX2's 16 registers. One key's score is a chain of NV dependent FMAs (4 cycles each),
// so four keys' chains run side by side; the weighted sum of V goes in slices of 64 dims whose partial
// sums stay in 8 registers over every key (attend_head's axpy stores and reloads `out` for each key: a
// chain through memory that bound the loop, as on AVX-512).
template <int NV, typename T>
OPTKIT_AVX2 __attribute__((flatten)) void attend_head_avx2_fixed(const float* q, const T* k, const T* v,
                                                                  const int64_t* table, int64_t first, int64_t n,
                                                                  int64_t block_size, int64_t slot_stride, float scale,
                                                                  float* scores, float* out) {
  static_assert(NV % 8 == 0, "slices of 8 vectors");
  float top = -INFINITY;
  for (int64_t j = first / block_size; j * block_size < n; ++j) {
    const int64_t start = std::max(j * block_size, first), stop = std::min((j + 1) * block_size, n);
    const T* kb = k + (table[j] * block_size - j * block_size) * slot_stride;  // + t * slot_stride: key t
    int64_t t = start;
    for (; t + 4 <= stop; t += 4) {
      const T* k0 = kb + t * slot_stride;
      __m256 dot[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
      for (int i = 0; i < NV; ++i) {
        const __m256 qi = _mm256_loadu_ps(q + 8 * i);
        for (int r = 0; r < 4; ++r) dot[r] = _mm256_fmadd_ps(qi, Avx2::load(k0 + r * slot_stride + 8 * i, 8), dot[r]);
      }
      for (int r = 0; r < 4; ++r) {
        const float s = Avx2::sum(dot[r]) * scale;
        scores[t + r - first] = s;
        top = std::max(top, s);
      }
    }
    for (; t < stop; ++t) {
      const float s = score_avx2<NV>(q, kb + t * slot_stride, scale);
      scores[t - first] = s;
      top = std::max(top, s);
    }
  }
  const float total = Avx2::exp_and_sum(scores, n - first, top);
  const __m256 inv = _mm256_set1_ps(1.f / total);
  for (int slice = 0; slice < NV / 8; ++slice) {
    __m256 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t j = first / block_size; j * block_size < n; ++j) {
      const int64_t start = std::max(j * block_size, first), stop = std::min((j + 1) * block_size, n);
      const T* vb = v + (table[j] * block_size - j * block_size) * slot_stride + 64 * slice;
      for (int64_t t = start; t < stop; ++t) {
        const __m256 p = _mm256_set1_ps(scores[t - first]);
        for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(p, Avx2::load(vb + t * slot_stride + 8 * i, 8), acc[i]);
      }
    }
    for (int i = 0; i < 8; ++i) _mm256_storeu_ps(out + 64 * slice + 8 * i, _mm256_mul_ps(acc[i], inv));
  }
}

template <typename T>
void attend_head_avx2(const float* q, const T* k, const T* v, const int64_t* table, int64_t first, int64_t n,
                      int64_t block_size, int64_t slot_stride, int64_t D, float scale, float* scores, float* out) {
  switch (D) {  // the head dims of the families (as attend_head_avx512); any other takes the loops
    case 64: return attend_head_avx2_fixed<8, T>(q, k, v, table, first, n, block_size, slot_stride, scale, scores, out);
    case 128: return attend_head_avx2_fixed<16, T>(q, k, v, table, first, n, block_size, slot_stride, scale, scores, out);
    case 256: return attend_head_avx2_fixed<32, T>(q, k, v, table, first, n, block_size, slot_stride, scale, scores, out);
    default: return attend_head_avx2_any<T>(q, k, v, table, first, n, block_size, slot_stride, D, scale, scores, out);
  }
}
#endif

// Query heads [begin, end) of the B * Hq (task b * Hq + h: head h of sequence b), on this thread
template <typename T>
void attend_tasks(const T* qp, const T* kp, const T* vp, T* op, const int64_t* tables, const int64_t* lens,
                  int64_t Hq, int64_t Hkv, int64_t D, int64_t nb, int64_t block_size, float scale, int64_t window,
                  bool avx512, int64_t begin, int64_t end) {
  const int64_t group = Hq / Hkv, slot_stride = Hkv * D;  // values from one slot's head to the next slot's
  thread_local std::vector<float> scores, q, out;  // each thread's, kept from call to call
  q.resize(D);
  out.resize(D);
  for (int64_t task = begin; task < end; ++task) {
    const int64_t b = task / Hq, h = task % Hq, n = lens[b];
    const int64_t first = window > 0 ? std::max<int64_t>(0, n - window) : 0;
    scores.resize(n - first);
    for (int64_t i = 0; i < D; ++i) q[i] = as_float(qp[task * D + i]);
    const T* k = kp + (h / group) * D;  // KV head h / group of slot 0
    const T* v = vp + (h / group) * D;
    const int64_t* table = tables + b * nb;
#if defined(__x86_64__)
    static const bool avx2 = cpu_isa::has_avx2_fma();
    if (avx512)
      attend_head_avx512<T>(q.data(), k, v, table, first, n, block_size, slot_stride, D, scale, scores.data(),
                            out.data());
    else if (avx2)
      attend_head_avx2<T>(q.data(), k, v, table, first, n, block_size, slot_stride, D, scale, scores.data(),
                          out.data());
    else
#endif
      attend_head<Portable, T>(q.data(), k, v, table, first, n, block_size, slot_stride, D, scale, scores.data(),
                               out.data());
    for (int64_t i = 0; i < D; ++i) op[task * D + i] = rounded<T>(out[i]);
  }
}

template <typename T>
void decode_attention_heads(const T* qp, const T* kp, const T* vp, T* op, const int64_t* tables, const int64_t* lens,
                            int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t nb, int64_t block_size, float scale,
                            int64_t window, bool avx512) {
  at::parallel_for(0, B * Hq, 1, [&](int64_t begin, int64_t end) {
    attend_tasks(qp, kp, vp, op, tables, lens, Hq, Hkv, D, nb, block_size, scale, window, avx512, begin, end);
  });
}

// One query token per sequence over the paged cache (grouped-query: query head h reads KV head
// h / (Hq / Hkv)). q [B, Hq, D]; k_cache, v_cache [N, block_size, Hkv, D] of q's dtype; block_tables
// long [B, nb]; lens long [B] (the keys of b, its query the last); window W > 0 keeps the last W keys;
// avx512: AVX-512 where the CPU has it (false: AVX2 with FMA where it has that, as on a CPU without AVX-512, else
// the portable loops).
//   out[b, h] = sum_t softmax_t(scale * q·k_t) v_t,  k_t at slot block_tables[b][t / bs] * bs + t % bs
void check_block_tables(const at::Tensor& block_tables, const at::Tensor& lens, int64_t B, int64_t num_blocks,
                        int64_t block_size);
at::Tensor attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& lens, double scale, int64_t window, bool avx512,
                  at::Tensor out = at::Tensor());

at::Tensor decode_attention(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& lens, double scale, int64_t window,
                            bool avx512) {
  TORCH_CHECK(is_float_or_bf16(q_in) && k_cache.scalar_type() == q_in.scalar_type() &&
                  v_cache.scalar_type() == q_in.scalar_type() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "q, k_cache, v_cache: float32 or bfloat16 CPU tensors of one dtype");
  TORCH_CHECK_VALUE(q_in.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
                    "decode_attention: q [B, Hq, D], k_cache and v_cache [N, block_size, Hkv, D] of one shape; got q ",
                    q_in.sizes(), ", k_cache ", k_cache.sizes(), ", v_cache ", v_cache.sizes());
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "k_cache, v_cache: contiguous");
  const at::Tensor q = q_in.contiguous();
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1), Hkv = k_cache.size(2);
  // Hkv >= 1 before Hq % Hkv, block_size >= 1 before the divisions by it: never a SIGFPE
  TORCH_CHECK_VALUE(Hq >= 1 && Hkv >= 1 && D >= 1 && block_size >= 1 && k_cache.size(3) == D && Hq % Hkv == 0,
                    "decode_attention: Hq a multiple of Hkv, D and block_size at least 1; got q ", q.sizes(),
                    ", k_cache ", k_cache.sizes());
  check_block_tables(block_tables, lens, B, num_blocks, block_size);
  return attend(q, k_cache, v_cache, block_tables, lens, scale, window, avx512);
}

// Every slot a decode reads lies inside the cache: block_tables long [B, nb], lens long [B] in 1..nb·bs.
void check_block_tables(const at::Tensor& block_tables, const at::Tensor& lens, int64_t B, int64_t num_blocks,
                        int64_t block_size) {
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() && block_tables.dim() == 2 &&
                  block_tables.size(0) == B,
              "block_tables: contiguous long [B, nb]");
  TORCH_CHECK(lens.scalar_type() == at::kLong && lens.is_contiguous() && lens.numel() == B, "lens: long [B]");
  const int64_t nb = block_tables.size(1);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= nb * block_size, "lens: between 1 and the blocks' slots");
    for (int64_t j = 0; j < (lp[b] + block_size - 1) / block_size; ++j)
      TORCH_CHECK(tables[b * nb + j] >= 0 && tables[b * nb + j] < num_blocks, "block_tables: a block outside the cache");
  }
}

// decode_attention over checked arguments: q contiguous [B, Hq, D]; into `out` where given (B·Hq·D
// contiguous values of q's dtype: [B, Hq, D] or a [B, Hq·D] the caller keeps).
at::Tensor attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& lens, double scale, int64_t window, bool avx512,
                  at::Tensor out) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), block_size = k_cache.size(1), Hkv = k_cache.size(2);
  const int64_t nb = block_tables.size(1);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  if (!out.defined()) out = at::empty({B, Hq, D}, q.options());
  const float s = static_cast<float>(scale);
  static const bool cpu_avx512 = cpu_isa::has_avx512();
  avx512 = avx512 && cpu_avx512;
  if (q.scalar_type() == at::kFloat)
    decode_attention_heads(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                           out.data_ptr<float>(), tables, lp, B, Hq, Hkv, D, nb, block_size, s, window, avx512);
  else
    decode_attention_heads(q.data_ptr<BFloat16>(), k_cache.data_ptr<BFloat16>(), v_cache.data_ptr<BFloat16>(),
                           out.data_ptr<BFloat16>(), tables, lp, B, Hq, Hkv, D, nb, block_size, s, window, avx512);
  return out;
}

// ---- A decode step's attention from the fused projection: qkv [B, (Hq + 2 Hkv) D], q | k | v as
// models/llama.py's qkv_proj writes them (rows at any stride, each row contiguous). Per sequence b:
// each query and key head normalized (per-head RMSNorm weights [D], optional, as rms_norm) and
// rotated (as rope), its key and value heads written to the cache at slot slot_mapping[b], then
// decode_attention over the cache. The model code's q/k norms, rope, write_kv and decode_attention in
// one call, with their bits: each step rounds where one of those operators writes a T tensor.
// Tasks [begin, end) of the B * (Hq + Hkv + 1), on this thread: task b * (Hq + Hkv + 1) + h is query head h
// (h < Hq), key head h - Hq (h < Hq + Hkv) or the value heads (the last) of sequence b
template <typename T, typename W>
void norm_rotate_store_tasks(const T* qkv, int64_t row_stride, const W* q_norm, const W* k_norm, float eps,
                             bool cast_first, float offset, const T* cos, const T* sin, int64_t R, const int64_t* slots,
                             T* q_out, T* k_cache, T* v_cache, int64_t Hq, int64_t Hkv, int64_t D, int64_t begin,
                             int64_t end) {
  thread_local std::vector<T> normed;  // each thread's, kept from call to call
  normed.resize(D);
  const int64_t per_sequence = Hq + Hkv + 1;
  for (int64_t task = begin; task < end; ++task) {
    const int64_t b = task / per_sequence, h = task % per_sequence;
    const T* row = qkv + b * row_stride;
    if (h == Hq + Hkv) {
      std::copy(row + (Hq + Hkv) * D, row + (Hq + 2 * Hkv) * D, v_cache + slots[b] * Hkv * D);
      continue;
    }
    const T* x = row + h * D;
    const W* weight = h < Hq ? q_norm : k_norm;
    if (weight != nullptr) {
      rms_norm_row(x, weight, normed.data(), D, eps, cast_first, offset);
      x = normed.data();
    }
    T* y = h < Hq ? q_out + (b * Hq + h) * D : k_cache + (slots[b] * Hkv + h - Hq) * D;
    rope_head(x, cos + b * R, sin + b * R, y, D, R);
  }
}

template <typename T, typename W>
void norm_rotate_store(const T* qkv, int64_t row_stride, const W* q_norm, const W* k_norm, float eps, bool cast_first,
                       float offset, const T* cos, const T* sin, int64_t R, const int64_t* slots, T* q_out, T* k_cache,
                       T* v_cache, int64_t B, int64_t Hq, int64_t Hkv, int64_t D) {
  const int64_t per_sequence = Hq + Hkv + 1;
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    norm_rotate_store_tasks(qkv, row_stride, q_norm, k_norm, eps, cast_first, offset, cos, sin, R, slots, q_out,
                            k_cache, v_cache, Hq, Hkv, D, begin * per_sequence, end * per_sequence);
  });
}

template <typename W>
const W* data_or_null(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr<W>() : nullptr;
}

// norm_rotate_store for activations of T and norm weights of either dtype (both of one): every task
// across ATen's threads, or (`tasks`) only tasks [begin, end), on this thread
template <typename T>
void norm_rotate_store_for(const at::Tensor& qkv, const c10::optional<at::Tensor>& q_norm,
                           const c10::optional<at::Tensor>& k_norm, float eps, bool cast_first, float offset,
                           const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots, at::Tensor& q,
                           at::Tensor& k_cache, at::Tensor& v_cache,
                           c10::optional<std::pair<int64_t, int64_t>> tasks = c10::nullopt) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(2), R = cos.size(-1);
  const auto run = [&](const auto* q_weight, const auto* k_weight) {
    if (tasks.has_value())
      norm_rotate_store_tasks(qkv.data_ptr<T>(), qkv.stride(0), q_weight, k_weight, eps, cast_first, offset,
                              cos.data_ptr<T>(), sin.data_ptr<T>(), R, slots.data_ptr<int64_t>(), q.data_ptr<T>(),
                              k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), Hq, Hkv, D, tasks->first, tasks->second);
    else
      norm_rotate_store(qkv.data_ptr<T>(), qkv.stride(0), q_weight, k_weight, eps, cast_first, offset,
                        cos.data_ptr<T>(), sin.data_ptr<T>(), R, slots.data_ptr<int64_t>(), q.data_ptr<T>(),
                        k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), B, Hq, Hkv, D);
  };
  const auto& any_norm = q_norm.has_value() ? q_norm : k_norm;
  if (any_norm.has_value() && any_norm->scalar_type() == at::kBFloat16)
    run(data_or_null<BFloat16>(q_norm), data_or_null<BFloat16>(k_norm));
  else
    run(data_or_null<float>(q_norm), data_or_null<float>(k_norm));
}

// decode_attention_qkv's checks: every shape, dtype and slot its arguments must have (raising ValueError
// or RuntimeError), before any of them is read
void check_attention_qkv(const at::Tensor& qkv, const c10::optional<at::Tensor>& q_norm,
                         const c10::optional<at::Tensor>& k_norm, const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slot_mapping,
                         const at::Tensor& block_tables, const at::Tensor& lens, int64_t num_heads) {
  TORCH_CHECK(is_float_or_bf16(qkv) && k_cache.scalar_type() == qkv.scalar_type() &&
                  v_cache.scalar_type() == qkv.scalar_type() && cos.scalar_type() == qkv.scalar_type() &&
                  sin.scalar_type() == qkv.scalar_type() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "qkv, cos, sin, k_cache, v_cache: float32 or bfloat16 CPU tensors of one dtype");
  TORCH_CHECK_VALUE(qkv.dim() == 2 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
                    "decode_attention_qkv: qkv [B, (Hq + 2 Hkv) D], k_cache and v_cache [N, block_size, Hkv, D] of one "
                    "shape; got qkv ", qkv.sizes(), ", k_cache ", k_cache.sizes(), ", v_cache ", v_cache.sizes());
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && qkv.stride(1) == 1,
              "k_cache, v_cache: contiguous; qkv: rows contiguous");
  const int64_t B = qkv.size(0), Hq = num_heads, num_blocks = k_cache.size(0), block_size = k_cache.size(1);
  const int64_t Hkv = k_cache.size(2), D = k_cache.size(3), R = cos.size(-1);
  TORCH_CHECK_VALUE(Hq >= 1 && Hkv >= 1 && D >= 1 && block_size >= 1 && Hq % Hkv == 0 &&
                        qkv.size(1) == (Hq + 2 * Hkv) * D,
                    "decode_attention_qkv: qkv [B, (Hq + 2 Hkv) D] with Hq a multiple of Hkv; got qkv ", qkv.sizes(),
                    ", ", Hq, " query heads, k_cache ", k_cache.sizes());
  TORCH_CHECK_VALUE(cos.numel() == B * R && sin.numel() == B * R && R % 2 == 0 && R <= D && cos.is_contiguous() &&
                        sin.is_contiguous(),
                    "decode_attention_qkv: cos, sin contiguous [B, 1, R], R even and at most the head dim; got cos ",
                    cos.sizes(), " for qkv ", qkv.sizes());
  for (const auto* w : {&q_norm, &k_norm})
    TORCH_CHECK_VALUE(!w->has_value() || ((*w)->dim() == 1 && (*w)->numel() == D && (*w)->is_contiguous() &&
                                          is_float_or_bf16(**w)),
                      "decode_attention_qkv: q/k norm weights: contiguous float32 or bfloat16 [D]");
  TORCH_CHECK(!q_norm.has_value() || !k_norm.has_value() || q_norm->scalar_type() == k_norm->scalar_type(),
              "q_norm, k_norm: one dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == B,
              "slot_mapping: long [B]");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(slots[b] >= 0 && slots[b] < num_blocks * block_size, "slot_mapping: a slot outside the cache");
  check_block_tables(block_tables, lens, B, num_blocks, block_size);
}

// The rotated queries go to `q` and the attention to `out` where given ([B, Hq, D] and B·Hq·D
// contiguous values of qkv's dtype, the fused decode stack's), else to tensors of their own.
at::Tensor decode_attention_qkv_into(const at::Tensor& qkv, const c10::optional<at::Tensor>& q_norm,
                                     const c10::optional<at::Tensor>& k_norm, double eps, bool cast_first,
                                     double offset, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                                     at::Tensor v_cache, const at::Tensor& slot_mapping,
                                     const at::Tensor& block_tables, const at::Tensor& lens, int64_t num_heads,
                                     double scale, int64_t window, bool avx512, at::Tensor q, at::Tensor out) {
  check_attention_qkv(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, slot_mapping, block_tables, lens, num_heads);
  const int64_t B = qkv.size(0), Hq = num_heads, D = k_cache.size(3);
  if (!q.defined()) q = at::empty({B, Hq, D}, qkv.options());
  TORCH_CHECK(q.sizes() == at::IntArrayRef({B, Hq, D}) && q.is_contiguous() && q.scalar_type() == qkv.scalar_type() &&
                  (!out.defined() || (out.numel() == B * Hq * D && out.is_contiguous() &&
                                      out.scalar_type() == qkv.scalar_type())),
              "decode_attention_qkv: q [B, Hq, D] and out of B·Hq·D values, contiguous, of qkv's dtype");
  const float e = static_cast<float>(eps), o = static_cast<float>(offset);
  const bool first = cast_first && qkv.scalar_type() == at::kBFloat16;  // as rms_norm
  if (qkv.scalar_type() == at::kFloat)
    norm_rotate_store_for<float>(qkv, q_norm, k_norm, e, first, o, cos, sin, slot_mapping, q, k_cache, v_cache);
  else
    norm_rotate_store_for<BFloat16>(qkv, q_norm, k_norm, e, first, o, cos, sin, slot_mapping, q, k_cache, v_cache);
  return attend(q, k_cache, v_cache, block_tables, lens, scale, window, avx512, out);
}

at::Tensor decode_attention_qkv(const at::Tensor& qkv, const c10::optional<at::Tensor>& q_norm,
                                const c10::optional<at::Tensor>& k_norm, double eps, bool cast_first, double offset,
                                const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache,
                                const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& lens,
                                int64_t num_heads, double scale, int64_t window, bool avx512) {
  return decode_attention_qkv_into(qkv, q_norm, k_norm, eps, cast_first, offset, cos, sin, k_cache, v_cache,
                                   slot_mapping, block_tables, lens, num_heads, scale, window, avx512, at::Tensor(),
                                   at::Tensor());
}

// ---- Greedy decoding's argmax over each row of float32 logits [R, V]: torch.argmax's answer (the first
// index of the largest value, -0.0 equal to +0.0; a NaN counts as the largest, its first index).
// ATen's argmax reduction carries an index through every comparison and took ~45-70 µs a row of a
// 49,152-token vocabulary (~220 µs at 262,144), where its max alone takes 6; here one pass finds the
// max (and any NaN) 16 lanes at a time, a second the first index holding it.
int64_t argmax_row(const float* x, int64_t V) {
  float m = -INFINITY;
  for (int64_t i = 0; i < V; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > m) m = x[i];
  }
  for (int64_t i = 0; i < V; ++i)
    if (x[i] == m) return i;
  return 0;  // not reached: V >= 1 and some x[i] == m
}

#if defined(__x86_64__)
OPTKIT_AVX512 int64_t argmax_row_avx512(const float* x, int64_t V) {
  __m512 vmax = _mm512_set1_ps(-INFINITY);
  __mmask16 unordered = 0;
  int64_t i = 0;
  for (; i + 16 <= V; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    vmax = _mm512_max_ps(vmax, v);
  }
  float m = _mm512_reduce_max_ps(vmax);
  for (int64_t j = i; j < V; ++j) {
    if (std::isnan(x[j])) unordered = 1;
    else if (x[j] > m) m = x[j];
  }
  if (unordered) return argmax_row(x, V);  // a NaN: its first index, as the scalar loop finds it
  const __m512 vm = _mm512_set1_ps(m);
  for (i = 0; i + 16 <= V; i += 16) {
    const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), vm, _CMP_EQ_OQ);
    if (eq) return i + __builtin_ctz(eq);
  }
  for (; i < V; ++i)
    if (x[i] == m) return i;
  return 0;
}

// argmax_row_avx512's two passes 8 lanes wide, the maximum in four registers (the largest of any
// grouping is the same value; a NaN is found apart)
OPTKIT_AVX2 int64_t argmax_row_avx2(const float* x, int64_t V) {
  __m256 vmax[4], unordered = _mm256_setzero_ps();
  for (__m256& each : vmax) each = _mm256_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 32 <= V; i += 32)
    for (int r = 0; r < 4; ++r) {
      const __m256 v = _mm256_loadu_ps(x + i + 8 * r);
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      vmax[r] = _mm256_max_ps(vmax[r], v);
    }
  const __m256 top8 = _mm256_max_ps(_mm256_max_ps(vmax[0], vmax[1]), _mm256_max_ps(vmax[2], vmax[3]));
  __m128 top4 = _mm_max_ps(_mm256_castps256_ps128(top8), _mm256_extractf128_ps(top8, 1));
  top4 = _mm_max_ps(top4, _mm_movehl_ps(top4, top4));
  float m = _mm_cvtss_f32(_mm_max_ss(top4, _mm_movehdup_ps(top4)));
  bool nan = _mm256_movemask_ps(unordered) != 0;
  for (int64_t j = i; j < V; ++j) {
    if (std::isnan(x[j])) nan = true;
    else if (x[j] > m) m = x[j];
  }
  if (nan) return argmax_row(x, V);  // a NaN: its first index, as the scalar loop finds it
  const __m256 vm = _mm256_set1_ps(m);
  for (i = 0; i + 8 <= V; i += 8) {
    const int eq = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), vm, _CMP_EQ_OQ));
    if (eq) return i + __builtin_ctz(eq);
  }
  for (; i < V; ++i)
    if (x[i] == m) return i;
  return 0;
}
#endif

at::Tensor argmax_rows(const at::Tensor& logits, bool avx512) {
  TORCH_CHECK_VALUE(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(1) >= 1 &&
                        logits.device().is_cpu(),
                    "argmax: float32 logits [R, V] on the CPU; got ", logits.sizes());
  const at::Tensor x = logits.contiguous();
  const int64_t R = x.size(0), V = x.size(1);
  at::Tensor out = at::empty({R}, x.options().dtype(at::kLong));
  avx512 = avx512 && cpu_isa::has_avx512();
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
#if defined(__x86_64__)
      static const bool avx2 = cpu_isa::has_avx2_fma();
      if (avx512 || avx2) {
        op[r] = avx512 ? argmax_row_avx512(xp + r * V, V) : argmax_row_avx2(xp + r * V, V);
        continue;
      }
#endif
      op[r] = argmax_row(xp + r * V, V);
    }
  });
  return out;
}

// ---- A whole decoder layer of a decode step whose four linears are optkit W4A8 layers: with n(x) as
// rms_norm, L(x) as optkit_w4a8::linear (kernels/cpu_w4a8.cpp: its own library, which the caller has
// loaded; the result cast to x's dtype, as the Python wrapper casts it) and act SiLU (GELU's tanh
// approximation for Gemma),
//   pre-norms:      a = h + L_o(attn(L_qkv(n_in(h)))),         out = a + L_down(act(g) u)
//   sandwich norms: a = h + n_post_attn(L_o(attn(L_qkv(n_in(h))))), out = a + n_post_ffw(L_down(act(g) u))
// with g | u = L_gate_up(n_post_attn(a)) (pre-norms) or L_gate_up(n_pre_ffw(a)) (sandwich), attn as
// decode_attention_qkv. models/llama.py's DecoderLayer in one call: the same kernels, ATen's own
// activations, and adds and products rounded as ATen's (add_and_norm, multiply_in_place), so the same
// bits; what it saves is the Python and the ATen calls between them.
at::Tensor w4a8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& params,
                       const c10::optional<at::Tensor>& bias, int64_t n, int64_t group_size, int64_t isa,
                       const at::Tensor& out = at::Tensor()) {
  if (out.defined() && x.scalar_type() == at::kFloat) {  // into the stack's kept float32 [M, N]
    static const auto op_out =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("optkit_w4a8::linear_out", "")
            .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                        int64_t, int64_t, int64_t, at::Tensor)>();
    op_out.call(x, weight, params, bias, n, group_size, isa, out);
    return out;
  }
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("optkit_w4a8::linear", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                            int64_t, int64_t, int64_t)>();
  const at::Tensor y = op.call(x, weight, params, bias, n, group_size, isa);
  return y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
}

// The intermediate tensors of a decode layer, kept by the fused stack's call from one layer to the next
// for float32 activations (an at::empty and its free cost ~0.4 us, and a layer made ~11): `take` gives
// the same tensor back while the sizes asked for are the same. A single layer's call keeps none.
enum Slot { kQkv, kQ, kAttention, kO, kA, kANormed, kGateUp, kGate, kDown, kX0, kX1, kN0, kN1, kSlots };

class LayerBuffers {
 public:
  explicit LayerBuffers(bool keep) : keep_(keep) {}
  at::Tensor take(int slot, at::IntArrayRef sizes, const at::TensorOptions& options) {
    if (!keep_) return at::empty(sizes, options);
    at::Tensor& kept = slots_[slot];
    if (!kept.defined() || kept.sizes() != sizes || kept.scalar_type() != options.dtype())
      kept = at::empty(sizes, options);
    return kept;
  }

 private:
  bool keep_;
  std::array<at::Tensor, kSlots> slots_;
};

// y = x + r (each sum rounded to T, as ATen's add of two T tensors), and rms_norm(y) where `weight` is
// given, in one pass over rows [M, K]: the residual add and the norm that reads it without an ATen
// operator's dispatch and iterator between them.
template <typename T, typename W>
void add_rows(const T* x, const T* r, T* y, const W* weight, T* n, int64_t M, int64_t K, float eps, bool cast_first,
              float offset) {
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t k = 0; k < K; ++k) y[m * K + k] = rounded<T>(as_float(x[m * K + k]) + as_float(r[m * K + k]));
      if (weight != nullptr) rms_norm_row(y + m * K, weight, n + m * K, K, eps, cast_first, offset);
    }
  });
}

// A norm weight of rows of K: [K], contiguous, float32 or bfloat16
void check_norm_weight(const at::Tensor& weight, int64_t K) {
  TORCH_CHECK(weight.dim() == 1 && weight.numel() == K && weight.is_contiguous() && is_float_or_bf16(weight),
              "residual add: norm weight [K]");
}

// (x + r, rms_norm(x + r) or undefined): x, r [M, K] contiguous of one dtype; weight [K] or undefined.
// Into y and n where given (x's sizes and dtype, contiguous, neither x nor r), else tensors of their own.
std::pair<at::Tensor, at::Tensor> add_and_norm(const at::Tensor& x, const at::Tensor& r, const at::Tensor& weight,
                                               float eps, bool cast_first, float offset, at::Tensor y = at::Tensor(),
                                               at::Tensor n = at::Tensor()) {
  TORCH_CHECK(x.is_contiguous() && r.is_contiguous() && x.sizes() == r.sizes() &&
                  x.scalar_type() == r.scalar_type() && is_float_or_bf16(x),
              "residual add: contiguous float32 or bfloat16 tensors of one shape");
  const int64_t K = x.size(-1), M = x.numel() / K;
  if (weight.defined()) check_norm_weight(weight, K);
  if (!y.defined()) y = at::empty_like(x);
  if (!weight.defined())
    n = at::Tensor();
  else if (!n.defined())
    n = at::empty_like(x);
  for (const at::Tensor* out : {&y, &n})
    TORCH_CHECK(!out->defined() || (out->sizes() == x.sizes() && out->scalar_type() == x.scalar_type() &&
                                    out->is_contiguous()),
                "residual add: outputs of x's sizes and dtype, contiguous");
  const bool first = cast_first && x.scalar_type() == at::kBFloat16;  // as rms_norm
  const auto run = [&](auto* xp, auto* np) {
    using T = std::remove_pointer_t<decltype(xp)>;
    if (!weight.defined())
      add_rows<T, float>(xp, r.data_ptr<T>(), y.data_ptr<T>(), nullptr, nullptr, M, K, eps, first, offset);
    else if (weight.scalar_type() == at::kFloat)
      add_rows(xp, r.data_ptr<T>(), y.data_ptr<T>(), weight.data_ptr<float>(), np, M, K, eps, first, offset);
    else
      add_rows(xp, r.data_ptr<T>(), y.data_ptr<T>(), weight.data_ptr<BFloat16>(), np, M, K, eps, first, offset);
  };
  if (x.scalar_type() == at::kFloat)
    run(x.data_ptr<float>(), weight.defined() ? n.data_ptr<float>() : nullptr);
  else
    run(x.data_ptr<BFloat16>(), weight.defined() ? n.data_ptr<BFloat16>() : nullptr);
  return {y, n};
}

// gate[m, i] *= up[m, i] (each product rounded to T, as ATen's mul_): gate [M, I] contiguous, up rows at
// any stride (the second half of the gate | up projection)
void multiply_in_place(at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.is_contiguous() && gate.dim() == 2 && up.dim() == 2 && up.stride(1) == 1 &&
                  gate.sizes() == up.sizes() && gate.scalar_type() == up.scalar_type() && is_float_or_bf16(gate),
              "gated activation: gate [M, I] contiguous and up [M, I] rows of one dtype");
  const int64_t M = gate.size(0), I = gate.size(1), stride = up.stride(0);
  const auto run = [&](auto* g, const auto* u) {
    using T = std::remove_pointer_t<decltype(g)>;
    at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m)
        for (int64_t i = 0; i < I; ++i) g[m * I + i] = rounded<T>(as_float(g[m * I + i]) * as_float(u[m * stride + i]));
    });
  };
  if (gate.scalar_type() == at::kFloat)
    run(gate.data_ptr<float>(), up.data_ptr<float>());
  else
    run(gate.data_ptr<BFloat16>(), up.data_ptr<BFloat16>());
}

// Whether ATen's own kernels run at AVX-512 (its silu then takes Sleef_expf16_u10 for e^x), or at AVX2
// (Sleef_expf8_u10), asked once.
bool aten_runs_avx512() {
  static const bool avx512 = at::get_cpu_capability() == "AVX512";
  return avx512;
}
bool aten_runs_avx2() {
  static const bool avx2 = at::get_cpu_capability() == "AVX2";
  return avx2;
}

#if defined(__x86_64__)
extern "C" __m512 Sleef_expf16_u10(__m512);  // libtorch_cpu's: ATen's Vectorized<float>::exp on AVX-512

// y[i] = silu(g[i]) * u[i] over one row of n float32 values, as ATen's AVX-512 silu computes it and
// multiply_in_place multiplies: ATen's vectorized loop takes the row's chunks of 32 values,
// x / (1 + e^-x) with Sleef's e^x, and its scalar loop the rest, x / (1 + std::exp(-x)); each
// product then rounded to float32.
OPTKIT_AVX512 void silu_times_row(const float* g, const float* u, float* y, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512i sign = _mm512_set1_epi32(static_cast<int32_t>(0x80000000u));
  const int64_t vectorized = n - n % 32;
  for (int64_t i = 0; i < vectorized; i += 16) {
    const __m512 x = _mm512_loadu_ps(g + i);
    const __m512 minus_x = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), sign));  // ATen's neg()
    const __m512 silu = _mm512_div_ps(x, _mm512_add_ps(one, Sleef_expf16_u10(minus_x)));
    _mm512_storeu_ps(y + i, _mm512_mul_ps(silu, _mm512_loadu_ps(u + i)));
  }
  for (int64_t i = vectorized; i < n; ++i) y[i] = (g[i] / (1.f + std::exp(-g[i]))) * u[i];
}

extern "C" __m256 Sleef_expf8_u10(__m256);   // libtorch_cpu's: ATen's Vectorized<float>::exp on AVX2
extern "C" __m256 Sleef_tanhf8_u10(__m256);  // and its Vectorized<float>::tanh

// silu_times_row as ATen's AVX2 silu computes it: chunks of 16 values (two vectors of 8), the rest
// by its scalar loop
OPTKIT_AVX2 void silu_times_row_avx2(const float* g, const float* u, float* y, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  const int64_t vectorized = n - n % 16;
  for (int64_t i = 0; i < vectorized; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    const __m256 silu = _mm256_div_ps(x, _mm256_add_ps(one, Sleef_expf8_u10(_mm256_xor_ps(sign, x))));  // ATen's neg()
    _mm256_storeu_ps(y + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
  }
  for (int64_t i = vectorized; i < n; ++i) y[i] = (g[i] / (1.f + std::exp(-g[i]))) * u[i];
}

// y[i] = gelu_tanh(g[i]) * u[i] as ATen's AVX2 GELU (approximate="tanh") computes it: per chunk of 16,
// 0.5 x (1 + tanh(beta (x + kappa x^3))) with x^3 = (x x) x and Sleef's tanh, the rest by its scalar
// loop; in both, torch's build fuses x + kappa x^3 into one FMA (tests/kernels/test_cpu_decode.py
// checks every bit against ATen's)
OPTKIT_AVX2 void gelu_tanh_times_row_avx2(const float* g, const float* u, float* y, int64_t n) {
  const float beta = M_SQRT2 * M_2_SQRTPI * 0.5, kappa = 0.044715f;
  const __m256 beta_v = _mm256_set1_ps(beta), kappa_v = _mm256_set1_ps(kappa), one = _mm256_set1_ps(1.f),
               half = _mm256_set1_ps(0.5f);
  const int64_t vectorized = n - n % 16;
  for (int64_t i = 0; i < vectorized; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
    const __m256 inner = _mm256_mul_ps(beta_v, _mm256_fmadd_ps(kappa_v, cube, x));
    const __m256 gelu = _mm256_mul_ps(_mm256_mul_ps(half, x), _mm256_add_ps(one, Sleef_tanhf8_u10(inner)));
    _mm256_storeu_ps(y + i, _mm256_mul_ps(gelu, _mm256_loadu_ps(u + i)));
  }
  for (int64_t i = vectorized; i < n; ++i) {
    const float x = g[i];
    y[i] = (0.5f * x * (1.f + std::tanh(beta * std::fma(kappa, x * x * x, x)))) * u[i];
  }
}
#endif

// act(gate) * up from gate | up = gate_up [M, 2I] contiguous -> [M, I]: ATen's activation, then
// multiply_in_place. Where ATen's activation would run its AVX-512 or AVX2 loops on one thread over
// rows of float32 (silu on either, GELU's tanh form on AVX2), both in one pass of a *_times_row: the
// same bits without its iterator, its allocation and a second pass over the gate.
// Into `out` (float32 [M, I] contiguous, the stack's) where given and that pass runs.
at::Tensor gated_activation_into(const at::Tensor& gate_up, bool gelu_tanh, bool avx512, at::Tensor out) {
  const int64_t M = gate_up.size(0), I = gate_up.size(1) / 2;
#if defined(__x86_64__)
  const bool row_avx512 = avx512 && aten_runs_avx512(), row_avx2 = !row_avx512 && aten_runs_avx2();
  // ATen's GELU runs on one thread up to 16,384 values, its silu below its grain size
  const bool one_thread = gelu_tanh ? M * I <= 16384 : M * I < at::internal::GRAIN_SIZE;
  if ((row_avx2 || (row_avx512 && !gelu_tanh)) && one_thread && gate_up.scalar_type() == at::kFloat &&
      gate_up.is_contiguous()) {
    if (!out.defined()) out = at::empty({M, I}, gate_up.options());
    TORCH_CHECK(out.sizes() == at::IntArrayRef({M, I}) && out.scalar_type() == at::kFloat && out.is_contiguous(),
                "gated activation: out float32 [M, I] contiguous");
    const float* g = gate_up.data_ptr<float>();
    float* y = out.data_ptr<float>();
    const auto row = gelu_tanh ? gelu_tanh_times_row_avx2 : row_avx512 ? silu_times_row : silu_times_row_avx2;
    for (int64_t m = 0; m < M; ++m) row(g + m * 2 * I, g + m * 2 * I + I, y + m * I, I);
    return out;
  }
#endif
  at::Tensor gate = gelu_tanh ? at::gelu(gate_up.narrow(1, 0, I), "tanh") : at::silu(gate_up.narrow(1, 0, I));
  multiply_in_place(gate, gate_up.narrow(1, I, I));  // act(gate) * up's bits
  return gate;
}

at::Tensor gated_activation(const at::Tensor& gate_up, bool gelu_tanh, bool avx512) {
  return gated_activation_into(gate_up, gelu_tanh, avx512, at::Tensor());
}

// A layer's output before its last residual add: (a, f) with the layer's output a + f (below). `normed`
// is n_in(h), which the caller computed (the stack joins it to the add before it); the intermediates
// come from `buffers` (h and normed may be none of them but the kX and kN slots).
std::pair<at::Tensor, at::Tensor> decode_layer_w4a8_parts(
    LayerBuffers& buffers, const at::Tensor& h, const at::Tensor& normed, at::TensorList weights, at::TensorList params,
    const c10::List<c10::optional<at::Tensor>>& biases, at::IntArrayRef out_features, at::IntArrayRef group_sizes,
    int64_t isa, const at::Tensor& post_attention_norm, const c10::optional<at::Tensor>& pre_feedforward_norm,
    const c10::optional<at::Tensor>& post_feedforward_norm, const c10::optional<at::Tensor>& q_norm,
    const c10::optional<at::Tensor>& k_norm, double eps, bool cast_first, double offset, bool gelu_tanh,
    const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& lens, int64_t num_heads,
    double scale, int64_t window, bool avx512) {
  const int64_t M = h.size(0), head_dim = k_cache.size(3);
  const auto take = [&](int slot, at::IntArrayRef sizes) { return buffers.take(slot, sizes, h.options()); };
  const auto linear = [&](const at::Tensor& x, int i, int slot) {
    const at::Tensor out = x.scalar_type() == at::kFloat ? take(slot, {M, out_features[i]}) : at::Tensor();
    return w4a8_linear(x, weights[i], params[i], biases.get(i), out_features[i], group_sizes[i], isa, out);
  };
  const auto norm = [&](const at::Tensor& x, const at::Tensor& weight) {
    return rms_norm(x, weight, eps, cast_first, offset);
  };
  const float e = static_cast<float>(eps), o = static_cast<float>(offset);
  const bool sandwich = pre_feedforward_norm.has_value();
  const at::Tensor attention = take(kAttention, {M, num_heads * head_dim});  // [M, Hq, D] as o_proj reads it
  decode_attention_qkv_into(linear(normed, 0, kQkv), q_norm, k_norm, eps, cast_first, offset, cos, sin, k_cache,
                            v_cache, slot_mapping, block_tables, lens, num_heads, scale, window, avx512,
                            take(kQ, {M, num_heads, head_dim}), attention);
  at::Tensor out = linear(attention, 1, kO);
  const auto [a, a_normed] =
      add_and_norm(h, sandwich ? norm(out, post_attention_norm) : out,
                   sandwich ? *pre_feedforward_norm : post_attention_norm, e, cast_first, o, take(kA, h.sizes()),
                   take(kANormed, h.sizes()));
  const at::Tensor gate_up = linear(a_normed, 2, kGateUp);
  const at::Tensor gate_out = h.scalar_type() == at::kFloat ? take(kGate, {M, gate_up.size(1) / 2}) : at::Tensor();
  const at::Tensor gate = gated_activation_into(gate_up, gelu_tanh, avx512, gate_out);
  out = linear(gate, 3, kDown);
  return {a, sandwich ? norm(out, *post_feedforward_norm) : out};
}

at::Tensor decode_layer_w4a8(const at::Tensor& h, at::TensorList weights, at::TensorList params,
                             const c10::List<c10::optional<at::Tensor>>& biases, at::IntArrayRef out_features,
                             at::IntArrayRef group_sizes, int64_t isa, const at::Tensor& input_norm,
                             const at::Tensor& post_attention_norm, const c10::optional<at::Tensor>& pre_feedforward_norm,
                             const c10::optional<at::Tensor>& post_feedforward_norm,
                             const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
                             double eps, bool cast_first, double offset, bool gelu_tanh, const at::Tensor& cos,
                             const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache,
                             const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& lens,
                             int64_t num_heads, double scale, int64_t window, bool avx512) {
  TORCH_CHECK_VALUE(weights.size() == 4 && params.size() == 4 && biases.size() == 4 && out_features.size() == 4 &&
                        group_sizes.size() == 4,
                    "decode_layer_w4a8: four linears (qkv, o, gate_up, down)");
  TORCH_CHECK_VALUE(pre_feedforward_norm.has_value() == post_feedforward_norm.has_value(),
                    "decode_layer_w4a8: the sandwich norms come in pairs");
  const at::Tensor x = h.contiguous();
  LayerBuffers buffers(false);
  const auto [a, f] = decode_layer_w4a8_parts(
      buffers, x, rms_norm(x, input_norm, eps, cast_first, offset), weights, params, biases, out_features, group_sizes,
      isa, post_attention_norm, pre_feedforward_norm, post_feedforward_norm, q_norm, k_norm, eps, cast_first, offset,
      gelu_tanh, cos, sin, k_cache, v_cache, slot_mapping, block_tables, lens, num_heads, scale, window, avx512);
  return add_and_norm(a, f, at::Tensor(), static_cast<float>(eps), cast_first, static_cast<float>(offset)).first;
}

// ---- The stack in one parallel region. Where the activations are float32 and few (a decode step of
// up to kOneRegionRows sequences), decode_stack_w4a8 runs every layer inside one OpenMP region of
// ATen's threads instead of ~5 regions a layer: an OpenMP region's start and end cost 0.65 us between
// two cores that share an L3 and 1.56 us across L3s, and the second thread's late start left the
// threads' ends ~1.7-2.8 us apart in every region; a step of SmolLM2 has ~150 (docs/results.md).
// Inside the region the threads meet at a SpinBarrier (~0.09 / 0.35 us) after each linear's tiles and each half
// of the attention. What every thread needs whole (the residual, the norms, the activation, each
// linear's quantized input) it computes itself, from the same inputs by the same code: the same bits on
// every thread, and no barrier before it. The work split between the threads is by tiles and heads,
// which do not depend on one another: the same bits as the regions' split.
constexpr int64_t kOneRegionRows = 4;

// Threads meeting on one cache line, as ggml's CPU backend's threads meet after each operation: each
// arrival is one atomic add, and the last one flips `released_`, which the others spin on. Each thread
// keeps its own `phase` (0 before its first wait).
class SpinBarrier {
 public:
  explicit SpinBarrier(int threads) : threads_(threads) {}
  void wait(int& phase) {
    phase ^= 1;
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == threads_ - 1) {
      arrived_.store(0, std::memory_order_relaxed);  // before the release: the next wait's adds see 0
      released_.store(phase, std::memory_order_release);
      return;
    }
    // spin, then yield: on shared cores the thread awaited may be descheduled, and the spinner would keep
    // its core from it
    for (int spins = 0; released_.load(std::memory_order_acquire) != phase; ++spins) {
      if (spins < kSpinsBeforeYield)
        pause();
      else
        std::this_thread::yield();
    }
  }

 private:
  static constexpr int kSpinsBeforeYield = 4096;  // tens of microseconds; a layer's wait is ~1-20
  static void pause() {
#if defined(__x86_64__)
    _mm_pause();
#endif
  }
  alignas(64) std::atomic<int> arrived_{0};
  std::atomic<int> released_{0};
  int threads_;
};

// One W4A8 linear as the region's threads run it: its checked packed weight, outputs, input columns
// and bias
struct RegionLinear {
  w4a8::Packed packed;
  int64_t n, K;
  const float* bias;  // or null
};

// cpu_w4a8.cpp's checks for an input of K float32 columns; nullopt where the region cannot run the
// linear as given (a bias not float32, which that library converts)
c10::optional<RegionLinear> region_linear(const at::Tensor& weight, const at::Tensor& params,
                                          const c10::optional<at::Tensor>& bias, int64_t n, int64_t K,
                                          int64_t group_size) {
  const w4a8::Packed packed = w4a8::check_packed(weight, params, n, K, group_size);
  if (!bias.has_value() || !bias->defined()) return RegionLinear{packed, n, K, nullptr};
  if (bias->scalar_type() != at::kFloat || !bias->is_contiguous()) return c10::nullopt;
  TORCH_CHECK_VALUE(bias->numel() == n, "w4a8 linear: bias [N]; got ", bias->sizes(), " for N ", n);
  return RegionLinear{packed, n, K, bias->data_ptr<float>()};
}

// [begin, end) of thread `tid` of `threads` over `count` tasks: at::parallel_for's static split
std::pair<int64_t, int64_t> share(int64_t count, int tid, int threads) {
  const int64_t chunk = (count + threads - 1) / threads;
  const int64_t begin = std::min(count, tid * chunk);
  return {begin, std::min(count, begin + chunk)};
}

// rms_norm of float32 x [M, K] into y, norm weights of either dtype (rms_norm's float32 cases)
void rms_norm_into(const at::Tensor& x, const at::Tensor& weight, float eps, float offset, at::Tensor& y) {
  const int64_t K = x.size(1), M = x.size(0);
  if (weight.scalar_type() == at::kFloat)
    rms_norm_rows(x.data_ptr<float>(), weight.data_ptr<float>(), y.data_ptr<float>(), M, K, eps, false, offset);
  else
    rms_norm_rows(x.data_ptr<float>(), weight.data_ptr<BFloat16>(), y.data_ptr<float>(), M, K, eps, false, offset);
}

// The CPUs this process may run on (its affinity mask), read once
int allowed_cpus() {
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
#endif
  return static_cast<int>(std::thread::hardware_concurrency());
}

// Whether decode_stack_w4a8 takes the one region where it can (the stack_in_one_region operator sets it:
// bench/cpu_stack_region.py's A/B in one process), and how many calls did
std::atomic<bool> one_region_enabled{true};
std::atomic<int64_t> one_region_calls{0};
std::atomic<bool> one_region_running{false};

bool stack_in_one_region(bool on) { return one_region_enabled.exchange(on); }
int64_t one_region_steps() { return one_region_calls.load(); }

// decode_stack_w4a8 (below, whose checks of the lists' sizes and indices ran) in one parallel region;
// nullopt where it cannot run so (bfloat16 or too many rows, one thread, layers of different sizes, a
// bias not float32), which the regions' path then runs
c10::optional<at::Tensor> decode_stack_w4a8_one_region(
    const at::Tensor& h, at::TensorList weights, at::TensorList params,
    const c10::List<c10::optional<at::Tensor>>& biases, at::IntArrayRef out_features, at::IntArrayRef group_sizes,
    int64_t isa, at::TensorList input_norms, at::TensorList post_attention_norms,
    const c10::List<c10::optional<at::Tensor>>& pre_feedforward_norms,
    const c10::List<c10::optional<at::Tensor>>& post_feedforward_norms,
    const c10::List<c10::optional<at::Tensor>>& q_norms, const c10::List<c10::optional<at::Tensor>>& k_norms,
    double eps, bool cast_first, double offset, bool gelu_tanh, at::TensorList cos, at::TensorList sin,
    at::IntArrayRef rope_index, at::TensorList k_caches, at::TensorList v_caches, at::TensorList slot_mappings,
    at::TensorList block_tables, at::TensorList lens, at::IntArrayRef group_index, int64_t num_heads, double scale,
    at::IntArrayRef windows, bool avx512) {
  const int threads = at::get_num_threads();
  const int64_t L = static_cast<int64_t>(input_norms.size());
  // more threads than CPUs to run them: a spinning thread would hold the CPU its peer waits for
  static const int cpus = allowed_cpus();
  if (!one_region_enabled.load(std::memory_order_relaxed) || threads < 2 || threads > cpus ||
      at::in_parallel_region() || L == 0 ||
      h.scalar_type() != at::kFloat || h.dim() != 2 || h.size(0) < 1 || h.size(0) > kOneRegionRows ||
      h.size(1) < 1 || k_caches[0].dim() != 4)
    return c10::nullopt;
  static const int64_t best_isa = cpu_isa::best();
  if ((isa != w4a8::kAvx2 && isa != w4a8::kAvx512Vnni) || isa > best_isa) return c10::nullopt;  // the linear says why
  const int64_t M = h.size(0), H = h.size(1), Hq = num_heads, Hkv = k_caches[0].size(2), D = k_caches[0].size(3);
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t i = 0; i < 4; ++i)
      if (out_features[4 * l + i] != out_features[i]) return c10::nullopt;
    if (k_caches[l].dim() != 4 || k_caches[l].size(2) != Hkv || k_caches[l].size(3) != D) return c10::nullopt;
  }
  const int64_t n_qkv = out_features[0], n_gate_up = out_features[2];
  if (out_features[1] != H || out_features[3] != H || n_gate_up % 2 != 0 || Hq < 1) return c10::nullopt;
  const at::TensorOptions f32 = h.options();
  at::Tensor qkv = at::empty({M, n_qkv}, f32), q = at::empty({M, Hq, D}, f32), attention = at::empty({M, Hq * D}, f32),
             o = at::empty({M, H}, f32), gate_up = at::empty({M, n_gate_up}, f32), down = at::empty({M, H}, f32);
  // every check before the region: nothing inside it may throw
  std::vector<RegionLinear> linears;
  linears.reserve(4 * L);
  const std::array<int64_t, 4> in_features{H, Hq * D, H, n_gate_up / 2};
  int64_t scratch_floats = 0;
  for (int64_t l = 0; l < L; ++l) {
    const int64_t r = rope_index[l], g = group_index[l];
    for (int64_t i = 0; i < 4; ++i) {
      const auto linear = region_linear(weights[4 * l + i], params[4 * l + i], biases.get(4 * l + i),
                                        out_features[4 * l + i], in_features[i], group_sizes[4 * l + i]);
      if (!linear.has_value()) return c10::nullopt;
      linears.push_back(*linear);
      scratch_floats = std::max(scratch_floats, M * (linear->packed.B + linear->packed.G) + (M * linear->K + 3) / 4);
    }
    check_attention_qkv(qkv, q_norms.get(l), k_norms.get(l), cos[r], sin[r], k_caches[l], v_caches[l],
                        slot_mappings[g], block_tables[g], lens[g], num_heads);
    for (const at::Tensor& weight : {input_norms[l], post_attention_norms[l]}) check_norm_weight(weight, H);
    for (const c10::optional<at::Tensor>& weight : {pre_feedforward_norms.get(l), post_feedforward_norms.get(l)})
      if (weight.has_value()) check_norm_weight(*weight, H);
  }
  // what each thread computes whole for itself: the residual x and its norm, a (after the attention)
  // and its norm, a sandwich norm's output, the activation, the linears' quantized inputs
  struct Own {
    at::Tensor x, normed, a, a_normed, sandwich, gate;
    std::vector<float> scratch;
  };
  std::vector<Own> own(threads);
  for (Own& t : own) {
    for (at::Tensor* each : {&t.x, &t.normed, &t.a, &t.a_normed, &t.sandwich}) *each = at::empty({M, H}, f32);
    t.gate = at::empty({M, n_gate_up / 2}, f32);
    t.scratch.resize(scratch_floats);
  }
  const at::Tensor x0 = h.contiguous(), normed0 = rms_norm(x0, input_norms[0], eps, cast_first, offset);
  const float e = static_cast<float>(eps), off = static_cast<float>(offset), s = static_cast<float>(scale);
  const bool attention_avx512 = avx512 && cpu_isa::has_avx512();  // as attend()
  // one such region at a time in this process: two engines' steps at once (routing, a shadow model)
  // would put more spinning threads than CPUs; the second runs the regions' path
  if (one_region_running.exchange(true, std::memory_order_acquire)) return c10::nullopt;
  SpinBarrier barrier(threads);
  std::atomic<bool> ran{false};
#pragma omp parallel num_threads(threads)
  {
    // all or none: a team smaller than asked for (OMP_DYNAMIC, a thread limit) would never release the
    // barrier, and leaves the step to the regions' path
    if (omp_get_num_threads() == threads) {
      const int tid = omp_get_thread_num();
      Own& mine = own[tid];
      int phase = 0;
      const auto linear = [&](const float* in, const RegionLinear& lin, float* y) {
        const w4a8::Packed& w = lin.packed;
        float* d = mine.scratch.data();
        float* xs = d + M * w.B;
        int8_t* quantized = reinterpret_cast<int8_t*>(xs + M * w.G);
        for (int64_t m = 0; m < M; ++m)
          w4a8::quantize_row_for(isa, in + m * lin.K, lin.K, w.group_blocks, quantized + m * lin.K, d + m * w.B,
                                 xs + m * w.G);
        const w4a8::Problem pr{w.weight, w.params, lin.bias, quantized, d, xs, y, M, lin.n, lin.K, w.B, w.G,
                               w.group_blocks};
        const auto [begin, end] = share(w.T, tid, threads);
        if (w.bf16_params)
          w4a8::run_tile_range<true>(pr, begin, end, isa);
        else
          w4a8::run_tile_range<false>(pr, begin, end, isa);
        barrier.wait(phase);  // the output whole before anyone reads it
      };
      at::Tensor x = x0, normed = normed0;
      for (int64_t l = 0; l < L; ++l) {
        const int64_t r = rope_index[l], g = group_index[l];
        at::Tensor k_cache = k_caches[l], v_cache = v_caches[l];
        const RegionLinear* lin = linears.data() + 4 * l;
        const bool sandwich = pre_feedforward_norms.get(l).has_value();
        linear(normed.data_ptr<float>(), lin[0], qkv.data_ptr<float>());
        norm_rotate_store_for<float>(qkv, q_norms.get(l), k_norms.get(l), e, false, off, cos[r], sin[r],
                                     slot_mappings[g], q, k_cache, v_cache, share(M * (Hq + Hkv + 1), tid, threads));
        barrier.wait(phase);  // the new keys and values in the cache
        const auto [begin, end] = share(M * Hq, tid, threads);
        attend_tasks(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                     attention.data_ptr<float>(), block_tables[g].data_ptr<int64_t>(), lens[g].data_ptr<int64_t>(), Hq,
                     Hkv, D, block_tables[g].size(1), k_cache.size(1), s, windows[l], attention_avx512, begin, end);
        barrier.wait(phase);
        linear(attention.data_ptr<float>(), lin[1], o.data_ptr<float>());
        if (sandwich) rms_norm_into(o, post_attention_norms[l], e, off, mine.sandwich);
        const at::Tensor a_norm = sandwich ? *pre_feedforward_norms.get(l) : post_attention_norms[l];
        add_and_norm(x, sandwich ? mine.sandwich : o, a_norm, e, cast_first, off, mine.a, mine.a_normed);
        linear(mine.a_normed.data_ptr<float>(), lin[2], gate_up.data_ptr<float>());
        const at::Tensor gate = gated_activation_into(gate_up, gelu_tanh, avx512, mine.gate);
        linear(gate.data_ptr<float>(), lin[3], down.data_ptr<float>());
        if (sandwich) rms_norm_into(down, *post_feedforward_norms.get(l), e, off, mine.sandwich);
        const at::Tensor next_norm = l + 1 < L ? input_norms[l + 1] : at::Tensor();
        std::tie(x, normed) = add_and_norm(mine.a, sandwich ? mine.sandwich : down, next_norm, e, cast_first, off,
                                           mine.x, next_norm.defined() ? mine.normed : at::Tensor());
      }
      if (tid == 0) ran.store(true, std::memory_order_relaxed);
    }
  }
  one_region_running.store(false, std::memory_order_release);
  if (!ran.load(std::memory_order_relaxed)) return c10::nullopt;
  one_region_calls.fetch_add(1, std::memory_order_relaxed);
  return own[0].x;
}

// ---- A decode step's whole decoder stack of W4A8 layers: decode_layer_w4a8 for layer l = 0..L-1 in
// turn, each layer's output the next one's h, in one call (what the model's loop and its Python per
// layer cost at batch 1). Per-layer arguments are flattened: linears 4l..4l+3 of weights, params,
// biases, out_features and group_sizes are layer l's; the norms, caches and windows are one entry a
// layer; layer l takes RoPE table rope_index[l] of cos and sin (Gemma's local and global) and the
// block table, slots and lens of its KV cache group group_index[l].
at::Tensor decode_stack_w4a8(const at::Tensor& h, at::TensorList weights, at::TensorList params,
                             const c10::List<c10::optional<at::Tensor>>& biases, at::IntArrayRef out_features,
                             at::IntArrayRef group_sizes, int64_t isa, at::TensorList input_norms,
                             at::TensorList post_attention_norms,
                             const c10::List<c10::optional<at::Tensor>>& pre_feedforward_norms,
                             const c10::List<c10::optional<at::Tensor>>& post_feedforward_norms,
                             const c10::List<c10::optional<at::Tensor>>& q_norms,
                             const c10::List<c10::optional<at::Tensor>>& k_norms, double eps, bool cast_first,
                             double offset, bool gelu_tanh, at::TensorList cos, at::TensorList sin,
                             at::IntArrayRef rope_index, at::TensorList k_caches, at::TensorList v_caches,
                             at::TensorList slot_mappings, at::TensorList block_tables, at::TensorList lens,
                             at::IntArrayRef group_index, int64_t num_heads, double scale, at::IntArrayRef windows,
                             bool avx512) {
  const int64_t L = static_cast<int64_t>(input_norms.size());
  const auto per_layer = [L](size_t n) { return static_cast<int64_t>(n) == L; };
  const auto four_per_layer = [L](size_t n) { return static_cast<int64_t>(n) == 4 * L; };
  TORCH_CHECK_VALUE(four_per_layer(weights.size()) && four_per_layer(params.size()) &&
                        four_per_layer(biases.size()) && four_per_layer(out_features.size()) &&
                        four_per_layer(group_sizes.size()),
                    "decode_stack_w4a8: four linears a layer");
  TORCH_CHECK_VALUE(per_layer(post_attention_norms.size()) && per_layer(pre_feedforward_norms.size()) &&
                        per_layer(post_feedforward_norms.size()) && per_layer(q_norms.size()) &&
                        per_layer(k_norms.size()) && per_layer(rope_index.size()) && per_layer(k_caches.size()) &&
                        per_layer(v_caches.size()) && per_layer(group_index.size()) && per_layer(windows.size()),
                    "decode_stack_w4a8: one norm, cache, RoPE table, cache group and window a layer");
  TORCH_CHECK_VALUE(cos.size() == sin.size() && slot_mappings.size() == block_tables.size() &&
                        slot_mappings.size() == lens.size(),
                    "decode_stack_w4a8: cos and sin, slots, block tables and lens in pairs");
  for (int64_t l = 0; l < L; ++l) {  // before any layer writes its cache
    TORCH_CHECK_VALUE(rope_index[l] >= 0 && rope_index[l] < static_cast<int64_t>(cos.size()) && group_index[l] >= 0 &&
                          group_index[l] < static_cast<int64_t>(slot_mappings.size()),
                      "decode_stack_w4a8: a layer's RoPE table or cache group out of range");
    TORCH_CHECK_VALUE(pre_feedforward_norms.get(l).has_value() == post_feedforward_norms.get(l).has_value(),
                      "decode_stack_w4a8: the sandwich norms come in pairs");
  }
  if (L == 0) return h;
  if (const auto out = decode_stack_w4a8_one_region(
          h, weights, params, biases, out_features, group_sizes, isa, input_norms, post_attention_norms,
          pre_feedforward_norms, post_feedforward_norms, q_norms, k_norms, eps, cast_first, offset, gelu_tanh, cos, sin,
          rope_index, k_caches, v_caches, slot_mappings, block_tables, lens, group_index, num_heads, scale, windows,
          avx512))
    return *out;
  const float e = static_cast<float>(eps), o = static_cast<float>(offset);
  at::Tensor x = h.contiguous();
  at::Tensor normed = rms_norm(x, input_norms[0], eps, cast_first, offset);
  LayerBuffers buffers(x.scalar_type() == at::kFloat);  // where the W4A8 linears write float32 into them
  for (int64_t l = 0; l < L; ++l) {
    const int64_t r = rope_index[l], g = group_index[l];
    c10::List<c10::optional<at::Tensor>> layer_biases;
    layer_biases.reserve(4);
    for (int64_t i = 0; i < 4; ++i) layer_biases.push_back(biases.get(4 * l + i));
    const auto [a, f] = decode_layer_w4a8_parts(
        buffers, x, normed, weights.slice(4 * l, 4), params.slice(4 * l, 4), layer_biases, out_features.slice(4 * l, 4),
        group_sizes.slice(4 * l, 4), isa, post_attention_norms[l], pre_feedforward_norms.get(l),
        post_feedforward_norms.get(l), q_norms.get(l), k_norms.get(l), eps, cast_first, offset, gelu_tanh, cos[r],
        sin[r], k_caches[l], v_caches[l], slot_mappings[g], block_tables[g], lens[g], num_heads, scale, windows[l],
        avx512);
    // the layer's residual add, joined to the next layer's input norm, into the slots the layer before's
    // output did not take (layer l reads kX0/kN0 + (l + 1) % 2)
    const at::Tensor next_norm = l + 1 < L ? input_norms[l + 1] : at::Tensor();
    const at::Tensor next_x = buffers.take(kX0 + l % 2, a.sizes(), a.options());
    const at::Tensor next_normed =
        next_norm.defined() ? buffers.take(kN0 + l % 2, a.sizes(), a.options()) : at::Tensor();
    std::tie(x, normed) = add_and_norm(a, f, next_norm, e, cast_first, o, next_x, next_normed);
  }
  return x;
}

// ---- A decode step of a 4-bit artifact from its tokens to its logits in one call: the embedding's rows
// scaled as the config says, decode_stack_w4a8, the final norm and the W4A8 head. The same operators
// in the same order as the model's embed, stack call, norm and compute_logits (models/decode_steps.py),
// so the same bits; what it saves is their Python between the calls: a step streams the model's weights
// through the caches, so each Python object those calls touch is a cache miss (~0.3-0.6 ms a token on
// a 30-layer model, docs/results.md).
at::Tensor decode_token_w4a8(const at::Tensor& ids, const at::Tensor& embedding, double embed_scale,
                             const at::Tensor& final_norm, const at::Tensor& head_weight,
                             const at::Tensor& head_params, int64_t head_out_features, int64_t head_group_size,
                             at::TensorList weights, at::TensorList params,
                             const c10::List<c10::optional<at::Tensor>>& biases, at::IntArrayRef out_features,
                             at::IntArrayRef group_sizes, int64_t isa, at::TensorList input_norms,
                             at::TensorList post_attention_norms,
                             const c10::List<c10::optional<at::Tensor>>& pre_feedforward_norms,
                             const c10::List<c10::optional<at::Tensor>>& post_feedforward_norms,
                             const c10::List<c10::optional<at::Tensor>>& q_norms,
                             const c10::List<c10::optional<at::Tensor>>& k_norms, double eps, bool cast_first,
                             double offset, bool gelu_tanh, at::TensorList cos, at::TensorList sin,
                             at::IntArrayRef rope_index, at::TensorList k_caches, at::TensorList v_caches,
                             at::TensorList slot_mappings, at::TensorList block_tables, at::TensorList lens,
                             at::IntArrayRef group_index, int64_t num_heads, double scale, at::IntArrayRef windows,
                             bool avx512) {
  TORCH_CHECK_VALUE(ids.dim() == 1 && ids.scalar_type() == at::kLong, "decode_token_w4a8: ids long [B]; got ",
                    ids.scalar_type(), " ", ids.sizes());
  TORCH_CHECK_VALUE(embedding.dim() == 2, "decode_token_w4a8: embedding [vocab, hidden]; got ", embedding.sizes());
  at::Tensor h = at::embedding(embedding, ids);  // nn.Embedding's forward (its index checks included)
  if (embed_scale != 1.0) h.mul_(embed_scale);   // as `h * multiplier`: the scalar in h's dtype's math
  const at::Tensor x = decode_stack_w4a8(
      h, weights, params, biases, out_features, group_sizes, isa, input_norms, post_attention_norms,
      pre_feedforward_norms, post_feedforward_norms, q_norms, k_norms, eps, cast_first, offset, gelu_tanh, cos, sin,
      rope_index, k_caches, v_caches, slot_mappings, block_tables, lens, group_index, num_heads, scale, windows, avx512);
  const at::Tensor normed = rms_norm(x, final_norm, eps, cast_first, offset);
  const at::Tensor logits =
      w4a8_linear(normed, head_weight, head_params, c10::nullopt, head_out_features, head_group_size, isa);
  return logits.scalar_type() == at::kFloat ? logits : logits.to(at::kFloat);  // compute_logits' .float()
}

}  // namespace

TORCH_LIBRARY(optkit_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool cast_first, float offset) -> Tensor", &rms_norm);
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor", &rope);
  m.def("has_avx512() -> bool", &cpu_isa::has_avx512);
  m.def("has_avx2_fma() -> bool", &cpu_isa::has_avx2_fma);
  m.def("stack_in_one_region(bool on) -> bool", &stack_in_one_region);
  m.def("one_region_steps() -> int", &one_region_steps);
  m.def("argmax(Tensor logits, bool avx512) -> Tensor", &argmax_rows);
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor lens, float scale, "
        "int window, bool avx512) -> Tensor",
        &decode_attention);
  m.def("decode_attention_qkv(Tensor qkv, Tensor? q_norm, Tensor? k_norm, float eps, bool cast_first, float offset, "
        "Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, Tensor block_tables, "
        "Tensor lens, int num_heads, float scale, int window, bool avx512) -> Tensor",
        &decode_attention_qkv);
  m.def("gated_activation(Tensor gate_up, bool gelu_tanh, bool avx512) -> Tensor", &gated_activation);
  m.def("decode_layer_w4a8(Tensor h, Tensor[] weights, Tensor[] params, Tensor?[] biases, int[] out_features, "
        "int[] group_sizes, int isa, Tensor input_norm, Tensor post_attention_norm, Tensor? pre_feedforward_norm, "
        "Tensor? post_feedforward_norm, Tensor? q_norm, Tensor? k_norm, float eps, bool cast_first, float offset, "
        "bool gelu_tanh, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
        "Tensor block_tables, Tensor lens, int num_heads, float scale, int window, bool avx512) -> Tensor",
        &decode_layer_w4a8);
  m.def("decode_stack_w4a8(Tensor h, Tensor[] weights, Tensor[] params, Tensor?[] biases, int[] out_features, "
        "int[] group_sizes, int isa, Tensor[] input_norms, Tensor[] post_attention_norms, "
        "Tensor?[] pre_feedforward_norms, Tensor?[] post_feedforward_norms, Tensor?[] q_norms, Tensor?[] k_norms, "
        "float eps, bool cast_first, float offset, bool gelu_tanh, Tensor[] cos, Tensor[] sin, int[] rope_index, "
        "Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor[] slot_mappings, Tensor[] block_tables, "
        "Tensor[] lens, int[] group_index, int num_heads, float scale, int[] windows, bool avx512) -> Tensor",
        &decode_stack_w4a8);
  m.def("decode_token_w4a8(Tensor ids, Tensor embedding, float embed_scale, Tensor final_norm, Tensor head_weight, "
        "Tensor head_params, int head_out_features, int head_group_size, Tensor[] weights, Tensor[] params, "
        "Tensor?[] biases, int[] out_features, int[] group_sizes, int isa, Tensor[] input_norms, "
        "Tensor[] post_attention_norms, Tensor?[] pre_feedforward_norms, Tensor?[] post_feedforward_norms, "
        "Tensor?[] q_norms, Tensor?[] k_norms, float eps, bool cast_first, float offset, bool gelu_tanh, "
        "Tensor[] cos, Tensor[] sin, int[] rope_index, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, "
        "Tensor[] slot_mappings, Tensor[] block_tables, Tensor[] lens, int[] group_index, int num_heads, "
        "float scale, int[] windows, bool avx512) -> Tensor",
        &decode_token_w4a8);
}
