// The W4A8 kernels of cpu_w4a8.cpp (see there for the layout and the math): the activation
// quantization of one row and the tiles of 16 outputs, with no threads of their own, and the checks a
// packed weight passes. Included by cpu_w4a8.cpp, whose operators split the tiles across ATen's
// threads, and by cpu_decode.cpp, whose decode stack splits them inside one parallel region a step.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>

#include "cpu_isa.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace w4a8 {

constexpr int kBlock = 32;       // columns per activation block and per weight block
constexpr int kLanes = 16;       // outputs per tile
constexpr int kTileBytes = 256;  // one tile's block: 16 lanes x 32 columns x 4 bits
// How far ahead of its loads a thread asks for the weight stream (bytes; 16 blocks). At batch 1 a call
// streams 0.1-1 MB split across the threads, too short for the hardware prefetcher to reach the
// memory's bandwidth on its own (bench/cpu_prefetch.py)
constexpr int kPrefetchBytes = 4096;


using cpu_isa::kAvx2;
using cpu_isa::kAvx512Vnni;

#if defined(__x86_64__)
// Activation quantization of one row, as ggml's q8_0: per block of 32 columns d = max|x| / 127 and
// a = round(x · (127 / max|x|)) (to nearest even: the default rounding mode; a = 0 where max|x| = 0),
// and the per-group sums xs = Σ_b d[b] · Σ a (in block order). tests/kernels/test_cpu_w4a8.py checks
// both versions against these float32 steps in PyTorch. This one: 32 columns in two registers.
inline __attribute__((target("avx512f,avx512bw,avx512vl"))) void quantize_row_avx512(const float* x, int64_t K,
                                                                              int64_t group_blocks, int8_t* a,
                                                                              float* d, float* xs) {
  const int64_t blocks = K / kBlock;
  for (int64_t b = 0; b < blocks; ++b) {
    const __m512 x0 = _mm512_loadu_ps(x + b * kBlock), x1 = _mm512_loadu_ps(x + b * kBlock + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, inv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(a + b * kBlock), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(a + b * kBlock + 16), _mm512_cvtsepi32_epi8(q1));
    const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    d[b] = amax / 127.f;
    if (b % group_blocks == 0) xs[b / group_blocks] = 0.f;
    xs[b / group_blocks] += d[b] * static_cast<float>(sum);
  }
}

// quantize_row_avx512's numbers in four registers of 8 for AVX2: the int32 values packed to int8 by
// vpackssdw and vpacksswb (no saturation: |a| <= 127), whose interleaving of the 128-bit lanes one
// vpermd undoes.
inline __attribute__((target("avx2,fma"))) void quantize_row_avx2(const float* x, int64_t K, int64_t group_blocks,
                                                                 int8_t* a, float* d, float* xs) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const int64_t blocks = K / kBlock;
  for (int64_t b = 0; b < blocks; ++b) {
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + b * kBlock + 8 * i);
    __m256 top = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], magnitude), _mm256_and_ps(v[1], magnitude)),
                               _mm256_max_ps(_mm256_and_ps(v[2], magnitude), _mm256_and_ps(v[3], magnitude)));
    __m128 top4 = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    top4 = _mm_max_ps(top4, _mm_movehl_ps(top4, top4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(top4, _mm_movehdup_ps(top4)));
    const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    __m256i q[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(a + b * kBlock), _mm256_permutevar8x32_epi32(bytes, order));
    const __m256i sum8 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i sum4 = _mm_add_epi32(_mm256_castsi256_si128(sum8), _mm256_extracti128_si256(sum8, 1));
    sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, _MM_SHUFFLE(1, 0, 3, 2)));
    sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, _MM_SHUFFLE(2, 3, 0, 1)));
    const int32_t sum = _mm_cvtsi128_si32(sum4);
    d[b] = amax / 127.f;
    if (b % group_blocks == 0) xs[b / group_blocks] = 0.f;
    xs[b / group_blocks] += d[b] * static_cast<float>(sum);
  }
}
#endif

// One row's quantization with the instructions of `isa` (kAvx512Vnni or kAvx2): the same values
inline void quantize_row_for(int64_t isa, const float* x, int64_t K, int64_t group_blocks, int8_t* a, float* d,
                             float* xs) {
#if defined(__x86_64__)
  if (isa == kAvx512Vnni)
    quantize_row_avx512(x, K, group_blocks, a, d, xs);
  else
    quantize_row_avx2(x, K, group_blocks, a, d, xs);
#endif
}

struct Problem {
  const uint8_t* w;   // [T, B, 256]
  const void* p;      // float [T, G, 2, 16] or uint8 [T, G, 48] (bf16 s, int8 c)
  const float* bias;  // [N] or null
  const int8_t* a;    // [M, K]
  const float* d;     // [M, B]
  const float* xs;    // [M, G]
  float* y;           // [M, N]
  int64_t M, N, K, B, G, group_blocks;
};

#if defined(__x86_64__)

// ---- AVX-512 VNNI: vpdpbusd multiplies unsigned bytes (the nibbles) by signed bytes (a) and adds
// each 4 products into an int32 lane: one instruction per 16 outputs x 4 columns.
template <int MR, bool BF16>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma"))) void tile_avx512(
    const Problem& pr, int64_t t, int64_t m0) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  const uint8_t* wt = pr.w + t * pr.B * kTileBytes;
  for (int64_t g = 0; g < pr.G; ++g) {
    __m512 gacc[MR];
    for (int r = 0; r < MR; ++r) gacc[r] = _mm512_setzero_ps();
    for (int64_t b = g * pr.group_blocks; b < (g + 1) * pr.group_blocks; ++b) {
      const uint8_t* wb = wt + b * kTileBytes;
      for (int i = 0; i < 4; ++i) _mm_prefetch(reinterpret_cast<const char*>(wb + kPrefetchBytes + 64 * i), _MM_HINT_T0);
      __m512i lo[4], hi[4];
      for (int i = 0; i < 4; ++i) {
        const __m512i v = _mm512_loadu_si512(wb + 64 * i);
        lo[i] = _mm512_and_si512(v, nibble);
        hi[i] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      }
      for (int r = 0; r < MR; ++r) {
        const int32_t* ab = reinterpret_cast<const int32_t*>(pr.a + (m0 + r) * pr.K + b * kBlock);
        __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();  // two chains: latency
        s0 = _mm512_dpbusd_epi32(s0, lo[0], _mm512_set1_epi32(ab[0]));
        s1 = _mm512_dpbusd_epi32(s1, hi[0], _mm512_set1_epi32(ab[1]));
        s0 = _mm512_dpbusd_epi32(s0, lo[1], _mm512_set1_epi32(ab[2]));
        s1 = _mm512_dpbusd_epi32(s1, hi[1], _mm512_set1_epi32(ab[3]));
        s0 = _mm512_dpbusd_epi32(s0, lo[2], _mm512_set1_epi32(ab[4]));
        s1 = _mm512_dpbusd_epi32(s1, hi[2], _mm512_set1_epi32(ab[5]));
        s0 = _mm512_dpbusd_epi32(s0, lo[3], _mm512_set1_epi32(ab[6]));
        s1 = _mm512_dpbusd_epi32(s1, hi[3], _mm512_set1_epi32(ab[7]));
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
        gacc[r] = _mm512_fmadd_ps(dot, _mm512_set1_ps(pr.d[(m0 + r) * pr.B + b]), gacc[r]);
      }
    }
    __m512 s, sz;
    if constexpr (BF16) {  // bf16 -> float32: the 16 bits shifted to the top of each lane
      const uint8_t* pg = static_cast<const uint8_t*>(pr.p) + (t * pr.G + g) * 3 * kLanes;
      const __m256i s16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pg));
      s = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(s16), 16));
      const __m128i c8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(pg + 2 * kLanes));
      sz = _mm512_mul_ps(s, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c8)));
    } else {
      const float* pg = static_cast<const float*>(pr.p) + (t * pr.G + g) * 2 * kLanes;
      s = _mm512_loadu_ps(pg);
      sz = _mm512_loadu_ps(pg + kLanes);
    }
    for (int r = 0; r < MR; ++r) {
      acc[r] = _mm512_fmadd_ps(gacc[r], s, acc[r]);
      acc[r] = _mm512_fnmadd_ps(sz, _mm512_set1_ps(pr.xs[(m0 + r) * pr.G + g]), acc[r]);
    }
  }
  const int64_t n0 = t * kLanes;
  const int64_t valid = pr.N - n0 < kLanes ? pr.N - n0 : kLanes;
  const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
  const __m512 bias = pr.bias ? _mm512_maskz_loadu_ps(mask, pr.bias + n0) : _mm512_setzero_ps();
  for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(pr.y + (m0 + r) * pr.N + n0, mask, _mm512_add_ps(acc[r], bias));
}

// An empty instruction that takes v in a register and gives it back: GCC can no longer see through
// it, so the sums before it are not reassociated with those after
__attribute__((target("avx2"))) inline void keep_in_register(__m256i& v) { __asm__("" : "+x"(v)); }

// A group's scale s and scale x zero point sz for the 8 lanes of half h (0 or 1) of tile t, from
// float32 params [T, G, 2, 16] or uint8 [T, G, 48] (16 bf16 scales, then 16 int8 zero points)
template <bool BF16>
__attribute__((target("avx2,fma"))) inline void group_scales_avx2(const Problem& pr, int64_t t, int64_t g, int h,
                                                                 __m256& s, __m256& sz) {
  if constexpr (BF16) {  // bf16 -> float32: the 16 bits shifted to the top of each lane
    const uint8_t* pg = static_cast<const uint8_t*>(pr.p) + (t * pr.G + g) * 3 * kLanes;
    const __m128i s16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(pg + 16 * h));
    s = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(s16), 16));
    const __m128i c8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(pg + 2 * kLanes + 8 * h));
    sz = _mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c8)));
  } else {
    const float* pg = static_cast<const float*>(pr.p) + (t * pr.G + g) * 2 * kLanes;
    s = _mm256_loadu_ps(pg + 8 * h);
    sz = _mm256_loadu_ps(pg + kLanes + 8 * h);
  }
}

// ---- AVX2 (ggml's way without VNNI): vpmaddubsw multiplies unsigned by signed bytes and adds pairs
// into int16 (|sum| <= 8 * 2 * 15 * 127 = 30480 over a block: no saturation), vpmaddwd by ones
// widens pairs of those into int32. A tile's 16 lanes are two halves of 8 (bytes 0-31 and 32-63).
// tile_avx2 takes the one row of a decode step: each 64 bytes of a block gives both halves' products
// with the same two broadcast activations, and keep_in_register holds each half's int16 sum in a
// register (without it GCC sums the 16 products as a tree, holds the 8 broadcasts, and spills the
// group sums to the stack: 1.1-1.2x slower where the weights are cached). 2 to 4 rows take
// tile_avx2_rows, whose registers hold them.
template <bool BF16>
__attribute__((target("avx2,fma"))) void tile_avx2(const Problem& pr, int64_t t) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  const uint8_t* wt = pr.w + t * pr.B * kTileBytes;
  const int32_t* a = reinterpret_cast<const int32_t*>(pr.a);
  for (int64_t g = 0; g < pr.G; ++g) {
    __m256 gacc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = g * pr.group_blocks; b < (g + 1) * pr.group_blocks; ++b) {
      const uint8_t* wb = wt + b * kTileBytes;
      for (int i = 0; i < 4; ++i) _mm_prefetch(reinterpret_cast<const char*>(wb + kPrefetchBytes + 64 * i), _MM_HINT_T0);
      const int32_t* ab = a + b * (kBlock / 4);
      __m256i s16[2];
      for (int i = 0; i < 4; ++i) {
        const __m256i alo = _mm256_set1_epi32(ab[2 * i]), ahi = _mm256_set1_epi32(ab[2 * i + 1]);
        for (int h = 0; h < 2; ++h) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * i + 32 * h));
          const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_and_si256(v, nibble), alo),
                                             _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), nibble), ahi));
          s16[h] = i == 0 ? p : _mm256_add_epi16(s16[h], p);
          keep_in_register(s16[h]);
        }
      }
      for (int h = 0; h < 2; ++h) {
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16[h], ones));
        gacc[h] = _mm256_fmadd_ps(dot, _mm256_set1_ps(pr.d[b]), gacc[h]);
      }
    }
    for (int h = 0; h < 2; ++h) {
      __m256 s, sz;
      group_scales_avx2<BF16>(pr, t, g, h, s, sz);
      acc[h] = _mm256_fmadd_ps(gacc[h], s, acc[h]);
      acc[h] = _mm256_fnmadd_ps(sz, _mm256_set1_ps(pr.xs[g]), acc[h]);
    }
  }
  const int64_t n0 = t * kLanes;
  const int64_t valid = pr.N - n0 < kLanes ? pr.N - n0 : kLanes;
  alignas(32) float out[kLanes];
  _mm256_store_ps(out, acc[0]);
  _mm256_store_ps(out + 8, acc[1]);
  for (int64_t l = 0; l < valid; ++l) pr.y[n0 + l] = out[l] + (pr.bias ? pr.bias[n0 + l] : 0.f);
}

// tile_avx2's sums for 2 to 4 rows, arranged for AVX2's 16 registers: one 8-lane half of the tile at
// a time, each 8-column chunk's nibbles unpacked into 2 registers and used by every row at once, the
// rows' int16 sums, block sums and totals (3 MR registers) kept in registers. The same bits as
// tile_avx2 (the int16 sums are exact in any order). Without keep_in_register GCC reassociates the
// int16 sums across the rows into a tree whose 32 products spill to the stack (1.1-1.6x slower).
template <int MR, bool BF16>
__attribute__((target("avx2,fma"))) void tile_avx2_rows(const Problem& pr, int64_t t, int64_t m0) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const uint8_t* wt = pr.w + t * pr.B * kTileBytes;
  const int64_t n0 = t * kLanes;
  for (int h = 0; h < 2; ++h) {
    __m256 acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < pr.G; ++g) {
      __m256 gacc[MR];
      for (int r = 0; r < MR; ++r) gacc[r] = _mm256_setzero_ps();
      for (int64_t b = g * pr.group_blocks; b < (g + 1) * pr.group_blocks; ++b) {
        const uint8_t* wb = wt + b * kTileBytes + 32 * h;
        if (h == 0)  // the second half's pass finds the tile's column in the caches
          for (int i = 0; i < 4; ++i) _mm_prefetch(reinterpret_cast<const char*>(wb + kPrefetchBytes + 64 * i), _MM_HINT_T0);
        __m256i s16[MR];
        for (int i = 0; i < 4; ++i) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * i));
          const __m256i lo = _mm256_and_si256(v, nibble);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
          for (int r = 0; r < MR; ++r) {
            const int32_t* ab = reinterpret_cast<const int32_t*>(pr.a + (m0 + r) * pr.K + b * kBlock);
            const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(ab[2 * i])),
                                               _mm256_maddubs_epi16(hi, _mm256_set1_epi32(ab[2 * i + 1])));
            s16[r] = i == 0 ? p : _mm256_add_epi16(s16[r], p);
            keep_in_register(s16[r]);
          }
        }
        for (int r = 0; r < MR; ++r) {
          const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16[r], ones));
          gacc[r] = _mm256_fmadd_ps(dot, _mm256_set1_ps(pr.d[(m0 + r) * pr.B + b]), gacc[r]);
        }
      }
      __m256 s, sz;
      group_scales_avx2<BF16>(pr, t, g, h, s, sz);
      for (int r = 0; r < MR; ++r) {
        acc[r] = _mm256_fmadd_ps(gacc[r], s, acc[r]);
        acc[r] = _mm256_fnmadd_ps(sz, _mm256_set1_ps(pr.xs[(m0 + r) * pr.G + g]), acc[r]);
      }
    }
    const int64_t first = n0 + 8 * h;
    const int64_t valid = pr.N - first < 8 ? pr.N - first : 8;
    for (int r = 0; r < MR; ++r) {
      alignas(32) float out[8];
      _mm256_store_ps(out, acc[r]);
      float* yr = pr.y + (m0 + r) * pr.N + first;
      for (int64_t l = 0; l < valid; ++l) yr[l] = out[l] + (pr.bias ? pr.bias[first + l] : 0.f);
    }
  }
}

#endif  // __x86_64__

// Rows in chunks of 4 (a weight block loaded once serves 4 rows from registers), then the rest.
#define OPTKIT_ROW_CHUNKS(KERNEL)                                      \
  do {                                                                 \
    int64_t m = 0;                                                     \
    for (; m + 4 <= pr.M; m += 4) KERNEL<4, BF16>(pr, t, m);           \
    switch (pr.M - m) {                                                \
      case 3: KERNEL<3, BF16>(pr, t, m); break;                        \
      case 2: KERNEL<2, BF16>(pr, t, m); break;                        \
      case 1: KERNEL<1, BF16>(pr, t, m); break;                        \
      default: break;                                                  \
    }                                                                  \
  } while (0)

// A packed weight and its params, checked for an input of K columns and n outputs
struct Packed {
  const uint8_t* weight;  // [T, B, 256]
  const void* params;     // float [T, G, 2, 16] or uint8 [T, G, 48]
  bool bf16_params;
  int64_t T, B, G, group_blocks;
};

// The checks of a W4A8 linear's weight, params, outputs and group size (the shapes come from the
// model: a wrong one raises ValueError, the Python wrapper's user error; the group size is checked
// positive before K % group_size, so never a SIGFPE)
inline Packed check_packed(const at::Tensor& weight, const at::Tensor& params, int64_t n, int64_t K,
                           int64_t group_size) {
  TORCH_CHECK_VALUE(n >= 1 && K >= 1 && group_size >= kBlock && group_size % kBlock == 0 && K % group_size == 0,
                    "w4a8 linear: N >= 1 outputs and groups of a multiple of 32 columns dividing K; got N ", n, ", K ",
                    K, ", group size ", group_size);
  TORCH_CHECK_VALUE(weight.dim() == 3 && weight.scalar_type() == at::kByte && weight.size(2) == kTileBytes,
                    "w4a8 linear: weight uint8 [T, B, 256]; got ", weight.sizes());
  TORCH_CHECK(weight.is_contiguous(), "weight: contiguous");
  const int64_t T = weight.size(0), B = weight.size(1), G = K / group_size;
  TORCH_CHECK_VALUE(K == B * kBlock && T == (n + kLanes - 1) / kLanes,
                    "w4a8 linear: x and weight disagree on K or N; got K ", K, ", weight ", weight.sizes(), ", N ", n);
  const bool bf16_params = params.scalar_type() == at::kByte;
  TORCH_CHECK_VALUE((bf16_params && params.numel() == T * G * 3 * kLanes) ||
                        (params.scalar_type() == at::kFloat && params.numel() == T * G * 2 * kLanes),
                    "w4a8 linear: params float32 [T, G, 2, 16] or uint8 [T, G, 48]; got ", params.sizes());
  TORCH_CHECK(params.is_contiguous(), "params: contiguous");
  return Packed{weight.data_ptr<uint8_t>(), params.data_ptr(), bf16_params, T, B, G, group_size / kBlock};
}

// Tiles [begin, end) of every row of `pr`, with the kernel of `isa` (kAvx512Vnni or kAvx2)
template <bool BF16>
void run_tile_range(const Problem& pr, int64_t begin, int64_t end, int64_t isa) {
#if defined(__x86_64__)
  for (int64_t t = begin; t < end; ++t) {
    if (isa == kAvx512Vnni)
      OPTKIT_ROW_CHUNKS(tile_avx512);
    else if (pr.M == 1)
      tile_avx2<BF16>(pr, t);
    else
      OPTKIT_ROW_CHUNKS(tile_avx2_rows);
  }
#endif
}

}  // namespace w4a8
