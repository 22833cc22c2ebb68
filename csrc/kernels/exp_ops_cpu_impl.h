// silu(gate) * up and row logsumexp (see exp_ops_problem.h). Per-ISA kernel source: no include guard,
// included once per instruction set by exp_ops_cpu.cpp (isa_variants.inc). Single-threaded: a decode
// step's rows are a few thousand values, its logits one row of tens of thousands.

#include <cmath>

#include "simd.h"
#include "convert.h"
#include "work.h"
#include "row_ops.h"

namespace mlx_h2o {
namespace MLX_H2O_ISA_NS {

template <class Elem>
static void run_swiglu(const SwiGLUProblem& p) {
  using S = typename Elem::Storage;
  FloatBuffer row(p.type == ElemType::float32 ? 0 : p.n);
  for (int64_t r = 0; r < p.rows; ++r) {
    const S* g = static_cast<const S*>(p.gate) + r * p.ld;
    const S* u = static_cast<const S*>(p.up) + r * p.ld;
    const int64_t o = r * p.n;  // the row's first output
    if (p.type == ElemType::float32) {
      swiglu_row<Elem>(g, u, p.n, static_cast<float*>(p.out) + o);
    } else {
      swiglu_row<Elem>(g, u, p.n, row.p);
      for (int64_t i = 0; i < p.n; ++i) store_scalar(p.out, p.type, o + i, row.p[i]);
    }
  }
}

template <class Elem>
static void run_logsumexp(const LogSumExpProblem& p) {
  using S = typename Elem::Storage;
  constexpr float LOG2E = 1.4426950408889634f;
  for (int64_t r = 0; r < p.rows; ++r) {
    const S* x = static_cast<const S*>(p.x) + r * p.M;
    // The maximum, and whether a NaN is present (x != x), in 8 lanes and then the tail.
    v8f mv = splat(-__builtin_inff());
    v8i nan = {};
    int64_t j = 0;
    for (; j + 8 <= p.M; j += 8) {
      const v8f v = Elem::load8(x + j);
      mv = vmax(mv, v);
      nan |= v != v;
    }
    float m = hmax(mv);
    bool has_nan = false;
    for (int k = 0; k < 8; ++k) has_nan |= nan[k] != 0;
    for (; j < p.M; ++j) {
      const float v = Elem::load1(x + j);
      m = v > m ? v : m;
      has_nan |= v != v;
    }
    float result;
    if (has_nan) {
      result = __builtin_nanf("");
    } else if (std::isinf(m)) {  // +inf, or every value -inf
      result = m;
    } else {
      // exp(v - m) = exp2((v - m) * log2(e)) with arguments <= 0, exp2v's range.
      const v8f mm = splat(m), l2e = splat(LOG2E);
      v8f sv = zeros8();
      for (j = 0; j + 8 <= p.M; j += 8) sv += exp2v((Elem::load8(x + j) - mm) * l2e);
      float sum = hsum(sv);
      for (; j < p.M; ++j) sum += exp2s((Elem::load1(x + j) - m) * LOG2E);
      result = m + std::log(sum);
    }
    store_scalar(p.out, p.type, r, result);
  }
}

static void logsumexp_cpu_entry(const LogSumExpProblem& p) {
  with_float_elem(p.type, [&](auto elem) { run_logsumexp<decltype(elem)>(p); });
}

static void swiglu_cpu_entry(const SwiGLUProblem& p) {
  with_float_elem(p.type, [&](auto elem) { run_swiglu<decltype(elem)>(p); });
}

}  // namespace MLX_H2O_ISA_NS
}  // namespace mlx_h2o
