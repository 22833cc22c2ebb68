// The row ops that kernels of their own compute and that the quantized matmul also applies to its
// input rows before quantizing them (QuantizedMatmulProblem::norm, ::swiglu): one definition each,
// so that an op fused into a product gives the bits of the op on its own. Per-ISA kernel source
// like simd.h (no include guard).

#include <cmath>

namespace mlx_h2o {
namespace MLX_H2O_ISA_NS {

// out[d] = x[base + d] * rsqrt(mean(x^2) + eps) * weight[d * weight_stride] for d < D (weight null: 1),
// in float32, before rounding. The squares are summed with explicit fused multiply-adds: the kernels
// are built with -ffp-contract=fast, and `sum += v * v` was contracted in one caller's inlining and
// not in another's, which gave the norm inside a product other bits than the norm on its own.
static inline void rms_norm_row(const void* x, ElemType x_type, int64_t base, int D, const void* weight,
                                ElemType weight_type, int64_t weight_stride, float eps, float* out) {
  float sum = 0.0f;
  for (int d = 0; d < D; ++d) {
    const float v = load_scalar(x, x_type, base + d);
    out[d] = v;
    sum = __builtin_fmaf(v, v, sum);
  }
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(D) + eps);
  for (int d = 0; d < D; ++d) {
    const float w = weight ? load_scalar(weight, weight_type, d * weight_stride) : 1.0f;
    out[d] = out[d] * inv * w;
  }
}

// sigmoid(g) from e = exp(-|g|) <= 1, so exp2v only sees arguments <= 0 (its range): 1 / (1 + e)
// for g >= 0 and e / (1 + e) below.
static inline v8f silu_times(v8f g, v8f u) {
  const v8f e = exp2v(vmax(g, -g) * splat(-1.4426950408889634f));
  const v8f sig = (g >= zeros8() ? splat(1.0f) : e) / (splat(1.0f) + e);
  return g * sig * u;
}

// out[i] = silu(gate[i]) * up[i] for i < n, in float32, before rounding (Elem: gate's and up's
// storage, convert.h).
template <class Elem>
static inline void swiglu_row(const typename Elem::Storage* gate, const typename Elem::Storage* up, int64_t n,
                              float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store8(out + i, silu_times(Elem::load8(gate + i), Elem::load8(up + i)));
  for (; i < n; ++i) out[i] = silu_times(splat(Elem::load1(gate + i)), splat(Elem::load1(up + i)))[0];
}

}  // namespace MLX_H2O_ISA_NS
}  // namespace mlx_h2o
