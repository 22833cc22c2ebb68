// silu(gate) * up and row logsumexp (see exp_ops_problem.h). Per-ISA kernel source: no include guard,
// included once per instruction set by exp_ops_cpu.cpp (isa_variants.inc). Single-threaded: a decode
// step's rows are a few thousand values, its logits one row of tens of thousands.

#include <cmath>

#include "simd.h"
#include "convert.h"

namespace mlx_h2o {
namespace MLX_H2O_ISA_NS {

// sigmoid(g) from e = exp(-|g|) <= 1, so exp2v only sees arguments <= 0 (its range): 1 / (1 + e)
// for g >= 0 and e / (1 + e) below.
static inline v8f silu_times(v8f g, v8f u) {
  const v8f e = exp2v(vmax(g, -g) * splat(-1.4426950408889634f));
  const v8f sig = (g >= zeros8() ? splat(1.0f) : e) / (splat(1.0f) + e);
  return g * sig * u;
}

template <class Elem>
static void run_swiglu(const SwiGLUProblem& p) {
  using S = typename Elem::Storage;
  for (int64_t row = 0; row < p.rows; ++row) {
    const S* g = static_cast<const S*>(p.gate) + row * p.ld;
    const S* u = static_cast<const S*>(p.up) + row * p.ld;
    const int64_t o = row * p.n;  // the row's first output
    int64_t i = 0;
    if (p.type == ElemType::float32) {
      float* out = static_cast<float*>(p.out) + o;
      for (; i + 8 <= p.n; i += 8) store8(out + i, silu_times(Elem::load8(g + i), Elem::load8(u + i)));
    } else {
      alignas(32) float r[8];
      for (; i + 8 <= p.n; i += 8) {
        store8(r, silu_times(Elem::load8(g + i), Elem::load8(u + i)));
        for (int j = 0; j < 8; ++j) store_scalar(p.out, p.type, o + i + j, r[j]);
      }
    }
    for (; i < p.n; ++i) store_scalar(p.out, p.type, o + i, silu_times(splat(Elem::load1(g + i)), splat(Elem::load1(u + i)))[0]);
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
