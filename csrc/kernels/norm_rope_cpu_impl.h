// RMS normalisation and rotary embedding (see norm_rope_problem.h). Per-ISA kernel source: no include
// guard, included once per instruction set by norm_rope_cpu.cpp (isa_variants.inc). Single-threaded:
// a decode step's rows are a few hundred values.

#include <cmath>

#include "simd.h"
#include "convert.h"
#include "work.h"

namespace mlx_h2o {
namespace MLX_H2O_ISA_NS {

static void run_rms_norm(const RMSNormProblem& p) {
  FloatBuffer row(p.D);
  for (int r = 0; r < p.rows; ++r) {
    const int64_t base = static_cast<int64_t>(r) * p.D;
    float sum = 0.0f;
    for (int d = 0; d < p.D; ++d) {
      const float v = load_scalar(p.x, p.x_type, base + d);
      row.p[d] = v;
      sum += v * v;
    }
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(p.D) + p.eps);
    for (int d = 0; d < p.D; ++d) {
      const float w = p.weight ? load_scalar(p.weight, p.weight_type, d * p.weight_stride) : 1.0f;
      store_scalar(p.out, p.out_type, base + d, row.p[d] * inv * w);
    }
  }
}

static void run_rope(const RoPEProblem& p) {
  const int half = p.dims / 2;
  // cos / sin of each (row position, frequency), shared by every (b, h).
  FloatBuffer cs(2 * static_cast<int64_t>(p.L) * half), xf(p.D);
  // Angles in double: at position p an angle's float32 rounding alone moves cos / sin by ~p * 6e-8.
  for (int l = 0; l < p.L; ++l) {
    const double pos = static_cast<double>(p.offset + l) * p.scale;
    for (int i = 0; i < half; ++i) {
      const double theta = pos * std::exp(-static_cast<double>(i) * (std::log(static_cast<double>(p.base)) / half));
      cs.p[2 * (static_cast<int64_t>(l) * half + i)] = static_cast<float>(std::cos(theta));
      cs.p[2 * (static_cast<int64_t>(l) * half + i) + 1] = static_cast<float>(std::sin(theta));
    }
  }
  for (int b = 0; b < p.B; ++b)
    for (int h = 0; h < p.H; ++h)
      for (int l = 0; l < p.L; ++l) {
        const int64_t in = b * p.x.stride[0] + h * p.x.stride[1] + l * p.x.stride[2];
        const int64_t out = ((static_cast<int64_t>(b) * p.H + h) * p.L + l) * p.D;
        for (int d = 0; d < p.D; ++d) xf.p[d] = load_scalar(p.x.data, p.x.type, in + d * p.x.stride[3]);
        const float* c = cs.p + 2 * static_cast<int64_t>(l) * half;
        for (int i = 0; i < half; ++i) {
          const int i1 = p.traditional ? 2 * i : i, i2 = p.traditional ? 2 * i + 1 : i + half;
          const float x1 = xf.p[i1], x2 = xf.p[i2], co = c[2 * i], si = c[2 * i + 1];
          store_scalar(p.out, p.out_type, out + i1, x1 * co - x2 * si);
          store_scalar(p.out, p.out_type, out + i2, x1 * si + x2 * co);
        }
        for (int d = p.dims; d < p.D; ++d) store_scalar(p.out, p.out_type, out + d, xf.p[d]);
      }
}

static void rms_norm_cpu_entry(const RMSNormProblem& p) { run_rms_norm(p); }
static void rope_cpu_entry(const RoPEProblem& p) { run_rope(p); }

}  // namespace MLX_H2O_ISA_NS
}  // namespace mlx_h2o
