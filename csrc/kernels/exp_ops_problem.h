// Plain-data descriptions of two kernels built on the vectorized exp (simd.h exp2v), for ops whose
// stock CPU path on Linux is a loop of scalar exp calls (MLX's CPU SIMD width is 1 there):
// - the gated activation of a SwiGLU MLP, silu(gate) * up, one op per layer of a decode step (mlx-lm
//   writes it as an mx.compile'd function, a JIT-compiled scalar loop, ~25 us a call past a plain
//   elementwise op);
// - logsumexp over the last axis, which mlx-lm's generate_step takes of every step's logits (49152
//   values for the embedded model: ~0.6 ms of a decode step through MLX's CPU logsumexp).
#pragma once

#include <cstdint>

#include "elem_type.h"

namespace mlx_h2o {

/** out[r * n + i] = g * sigmoid(g) * u with g = gate[r * ld + i], u = up[r * ld + i], for r < rows and
 *  i < n, computed in float32 and rounded once. gate, up and out are of one dtype; a row of each is
 *  contiguous (one row of n: plain arrays; ld = 2n, up = gate + n: the halves of a packed product). */
struct SwiGLUProblem {
  int64_t rows = 1, n = 0, ld = 0;
  const void* gate = nullptr;
  const void* up = nullptr;
  ElemType type = ElemType::float32;
  void* out = nullptr;
};

/** out[r] = log(sum_j exp(x[r, j])) for the rows of a row-contiguous (rows, M) x, M >= 1, in float32
 *  and rounded once to `type` (x's and out's dtype). A row holding a NaN gives NaN; +inf gives +inf;
 *  a row of -inf gives -inf. */
struct LogSumExpProblem {
  int64_t rows = 0, M = 0;
  const void* x = nullptr;
  ElemType type = ElemType::float32;
  void* out = nullptr;
};

void swiglu_cpu(const SwiGLUProblem& p);
void logsumexp_cpu(const LogSumExpProblem& p);

}  // namespace mlx_h2o
