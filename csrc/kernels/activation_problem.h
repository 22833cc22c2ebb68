// Plain-data description of the gated activation of a SwiGLU MLP for the CPU kernel: silu(gate) * up,
// one op per layer of a decode step. mlx-lm writes it as an mx.compile'd function; on Linux that is a
// JIT-compiled loop of scalar exp calls, ~25 us a call past a plain elementwise op (30 a step on the
// embedded model).
#pragma once

#include <cstdint>

#include "elem_type.h"

namespace mlx_h2o {

/** out[i] = gate[i] * sigmoid(gate[i]) * up[i] for i < n, computed in float32 and rounded once.
 *  gate, up and out are contiguous and of one dtype. */
struct SwiGLUProblem {
  int64_t n = 0;
  const void* gate = nullptr;
  const void* up = nullptr;
  ElemType type = ElemType::float32;
  void* out = nullptr;
};

void swiglu_cpu(const SwiGLUProblem& p);

}  // namespace mlx_h2o
