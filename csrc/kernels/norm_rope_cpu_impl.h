// RMS normalisation and rotary embedding (see norm_rope_problem.h). Per-ISA kernel source: no include
// guard, included once per instruction set by norm_rope_cpu.cpp (isa_variants.inc). Single-threaded:
// a decode step's rows are a few hundred values.

#include <cmath>

#include "simd.h"
#include "convert.h"
#include "work.h"
#include "row_ops.h"

namespace mlx_h2o {
namespace MLX_H2O_ISA_NS {

static void run_rms_norm(const RMSNormProblem& p) {
  FloatBuffer row(p.D);
  for (int r = 0; r < p.rows; ++r) {
    const int64_t base = static_cast<int64_t>(r) * p.D;
    rms_norm_row(p.x, p.x_type, base, p.D, p.weight, p.weight_type, p.weight_stride, p.eps, row.p);
    for (int d = 0; d < p.D; ++d) store_scalar(p.out, p.out_type, base + d, row.p[d]);
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
        const bool tail = p.out_tail && h >= p.tail_from;
        void* const dst = tail ? p.out_tail : p.out;
        const int heads = !p.out_tail ? p.H : tail ? p.H - p.tail_from : p.tail_from;
        const int64_t out = ((static_cast<int64_t>(b) * heads + (tail ? h - p.tail_from : h)) * p.L + l) * p.D;
        for (int d = 0; d < p.D; ++d) xf.p[d] = load_scalar(p.x.data, p.x.type, in + d * p.x.stride[3]);
        const float* c = cs.p + 2 * static_cast<int64_t>(l) * half;
        for (int i = 0; i < half; ++i) {
          const int i1 = p.traditional ? 2 * i : i, i2 = p.traditional ? 2 * i + 1 : i + half;
          const float x1 = xf.p[i1], x2 = xf.p[i2], co = c[2 * i], si = c[2 * i + 1];
          store_scalar(dst, p.out_type, out + i1, x1 * co - x2 * si);
          store_scalar(dst, p.out_type, out + i2, x1 * si + x2 * co);
        }
        for (int d = p.dims; d < p.D; ++d) store_scalar(dst, p.out_type, out + d, xf.p[d]);
      }
}

static void rms_norm_cpu_entry(const RMSNormProblem& p) { run_rms_norm(p); }
static void rope_cpu_entry(const RoPEProblem& p) { run_rope(p); }

}  // namespace MLX_H2O_ISA_NS
}  // namespace mlx_h2o
