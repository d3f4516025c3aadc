// W4A8 linear on x86-64 CPUs: 4-bit weights x int8-quantized activations, int32 block dot products.
// Built at first use by optkit/kernels/cpu_w4a8.py (torch.utils.cpp_extension.load), which also packs
// the weights and documents the math. The kernels are in cpu_w4a8_tiles.h; this file's operators split
// their tiles across ATen's threads. One build serves both instruction sets: each kernel carries its
// own __attribute__((target(...))) and the caller picks one per call (cpuid, capped by an env var).
//
// Shapes: x [M, K] (float32, or converted); weight uint8 [T, B, 256] (T = ceil(N / 16) tiles of 16 outputs, B = K / 32
// blocks); params per tile and weight group, either float32 [T, G, 2, 16] (the scale s, then s * (8 + z))
// or, where every scale is a bfloat16 value, uint8 [T, G, 48] (16 bf16 s, then 16 int8 c = 8 + z: 3 bytes
// an output and group instead of 8; at batch 1 the kernel is bound by the bytes it reads). s * c is
// exact in float32 (8 + 4 significant bits), so both layouts give the same bits;
// y float32 [M, N].
// Within one tile and block, 256 bytes = 4 words w x 16 lanes (outputs) x 4 bytes j; byte j of word w
// of lane l holds u[l, 8w + j] in its low nibble and u[l, 8w + 4 + j] in its high nibble (u = q + 8).
// So one 64-byte load is 16 outputs x 8 columns, and the activation bytes a[8w .. 8w + 3] (low) and
// a[8w + 4 .. 8w + 7] (high) are 4 consecutive int8, broadcast as one int32 to every lane.
//
// Per row m, block b (32 columns, activation scale d[m, b], int8 a) and output n in group g:
//   y[m, n] = sum_g s[n, g] * (sum_{b in g} d[m, b] * dot(u[n, b], a[m, b])) - s[n, g] (8 + z[n, g]) * xs[m, g]
//   with xs[m, g] = sum_{b in g} d[m, b] * sum(a[m, b])
// since W[n, k] = (q - z) s = (u - 8 - z) s. dot() is exact in int32 (|u a| <= 15 * 127, 32 terms).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/to.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

#include "cpu_w4a8_tiles.h"

namespace {

using namespace w4a8;

constexpr int64_t kKeptScratchRows = 16;  // calls of up to this many rows quantize into a kept buffer

template <bool BF16>
void run_tiles(const Problem& pr, int64_t T, int64_t isa) {
#if defined(__x86_64__)
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) { run_tile_range<BF16>(pr, begin, end, isa); });
#endif
}

// An operator's `isa` argument: kAvx2 or kAvx512Vnni, and one this CPU runs
void check_isa(int64_t isa) {
  TORCH_CHECK(isa == kAvx2 || isa == kAvx512Vnni, "isa: 1 (AVX2) or 2 (AVX-512 VNNI)");
  static const int64_t best_isa = cpu_isa::best();
  TORCH_CHECK(isa <= best_isa, "this CPU lacks the requested instruction set");
}

// y = the linear of x into y: float32 [M, N] contiguous (`linear` allocates it, `linear_out` is given it).
void w4a8_linear_into(const at::Tensor& x_in, const at::Tensor& weight, const at::Tensor& params,
                      const c10::optional<at::Tensor>& bias_in, int64_t n, int64_t group_size, int64_t isa,
                      at::Tensor& y) {
  TORCH_CHECK_VALUE(x_in.dim() == 2 && x_in.is_floating_point(), "w4a8 linear: x float [M, K]; got ", x_in.sizes());
  const Packed packed = check_packed(weight, params, n, x_in.size(1), group_size);
  // no copy, and no dispatch of `to`, when it is already (a decode step makes ~120 of these calls)
  const auto as_float = [](const at::Tensor& t) {
    return (t.scalar_type() == at::kFloat ? t : t.to(at::kFloat)).contiguous();
  };
  const at::Tensor x = as_float(x_in);
  c10::optional<at::Tensor> bias;
  if (bias_in.has_value() && bias_in->defined()) bias = as_float(*bias_in);
  const int64_t M = x.size(0), K = x.size(1), T = packed.T, B = packed.B, G = packed.G;
  const int64_t group_blocks = packed.group_blocks;
  const bool bf16_params = packed.bf16_params;
  const float* bias_ptr = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->numel() == n, "w4a8 linear: bias [N]; got ", bias->sizes(), " for N ", n);
    bias_ptr = bias->data_ptr<float>();
  }
  check_isa(isa);

  // the quantized activations: d [M, B] and xs [M, G] (float), then a [M, K] (int8). At decode's few
  // rows in this thread's buffer, kept from call to call (a decode step makes ~120 of these calls; the
  // worker threads read it while this one waits for them); else in one allocation of their own
  const int64_t scratch_floats = M * (B + G) + (M * K + 3) / 4;
  thread_local std::vector<float> kept;
  at::Tensor own;
  float* dp;
  if (M <= kKeptScratchRows) {
    kept.resize(std::max<size_t>(kept.size(), scratch_floats));
    dp = kept.data();
  } else {
    own = at::empty({scratch_floats}, x.options());
    dp = own.data_ptr<float>();
  }
  if (!y.defined()) y = at::empty({M, n}, x.options());
  TORCH_CHECK_VALUE(y.scalar_type() == at::kFloat && y.is_contiguous() && y.dim() == 2 && y.size(0) == M &&
                        y.size(1) == n,
                    "w4a8 linear: out float32 [M, N] contiguous; got ", y.sizes(), " for M ", M, ", N ", n);
  float* xsp = dp + M * B;
  int8_t* ap = reinterpret_cast<int8_t*>(xsp + M * G);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      quantize_row_for(isa, xp + m * K, K, group_blocks, ap + m * K, dp + m * B, xsp + m * G);
  });
  const Problem pr{packed.weight, packed.params, bias_ptr, ap, dp, xsp,
                   y.data_ptr<float>(),        M, n, K, B, G, group_blocks};
  if (bf16_params)
    run_tiles<true>(pr, T, isa);
  else
    run_tiles<false>(pr, T, isa);
}

at::Tensor w4a8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& params,
                       const c10::optional<at::Tensor>& bias, int64_t n, int64_t group_size, int64_t isa) {
  at::Tensor y;
  w4a8_linear_into(x, weight, params, bias, n, group_size, isa, y);
  return y;
}

// The same into `out` (a float32 [M, N] the caller keeps: the fused decode stack's, rewritten layer
// after layer)
void w4a8_linear_out(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& params,
                     const c10::optional<at::Tensor>& bias, int64_t n, int64_t group_size, int64_t isa,
                     at::Tensor out) {
  TORCH_CHECK_VALUE(out.defined(), "w4a8 linear_out: an out tensor");
  w4a8_linear_into(x, weight, params, bias, n, group_size, isa, out);
}

// The int8 activations of x [M, K] float32 as the linear quantizes them, for tests: (a int8 [M, K],
// d [M, K / 32], xs [M, K / group_size])
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize(const at::Tensor& x, int64_t group_size, int64_t isa) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && group_size >= kBlock &&
                        group_size % kBlock == 0 && x.size(1) % group_size == 0,
                    "w4a8 quantize: x float32 [M, K] contiguous, groups of a multiple of 32 dividing K");
  check_isa(isa);
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor a = at::empty({M, K}, x.options().dtype(at::kChar)), d = at::empty({M, K / kBlock}, x.options()),
             xs = at::empty({M, K / group_size}, x.options());
  for (int64_t m = 0; m < M; ++m)
    quantize_row_for(isa, x.data_ptr<float>() + m * K, K, group_size / kBlock, a.data_ptr<int8_t>() + m * K,
                     d.data_ptr<float>() + m * (K / kBlock), xs.data_ptr<float>() + m * (K / group_size));
  return {a, d, xs};
}

}  // namespace

TORCH_LIBRARY(optkit_w4a8, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor params, Tensor? bias, int n, int group_size, int isa) -> Tensor",
        &w4a8_linear);
  m.def("linear_out(Tensor x, Tensor weight, Tensor params, Tensor? bias, int n, int group_size, int isa, "
        "Tensor(a!) out) -> ()",
        &w4a8_linear_out);
  m.def("cpu_isa() -> int", &cpu_isa::best);
  m.def("quantize(Tensor x, int group_size, int isa) -> (Tensor, Tensor, Tensor)", &quantize);
}
