// Plain-data descriptions of RMS normalisation and rotary position embedding for the CPU kernels:
// two small per-layer ops whose stock CPU path (MLX's fast-op fallbacks) is 11 and 29 primitives a
// call, i.e. most of a decode step's ~3000 primitives on a 30-layer model.
#pragma once

#include <cstdint>

#include "elem_type.h"

namespace mlx_h2o {

/** out (rows, D) = x * rsqrt(mean(x^2) + eps) * weight, computed in float32, rounded once. x and out
 *  row-contiguous; weight (D,) with stride weight_stride, or null. */
struct RMSNormProblem {
  int rows = 0, D = 0;
  const void* x = nullptr;
  ElemType x_type = ElemType::float32;
  const void* weight = nullptr;
  ElemType weight_type = ElemType::float32;
  int64_t weight_stride = 1;
  float eps = 1e-5f;
  void* out = nullptr;
  ElemType out_type = ElemType::float32;
};

/** out (B, H, L, D) row-contiguous = x (B, H, L, D, any strides) with the first `dims` features of
 *  row l rotated by angles ((offset + l) * scale) * base^(-i / (dims / 2)), i < dims / 2: pairs
 *  (i, i + dims / 2), or (2i, 2i + 1) when `traditional`; features past `dims` copied (dims 0: a
 *  strided copy). */
struct RoPEProblem {
  int B = 0, H = 0, L = 0, D = 0, dims = 0;
  View4 x;
  bool traditional = false;
  float base = 10000.0f, scale = 1.0f;
  int offset = 0;
  void* out = nullptr;
  ElemType out_type = ElemType::float32;
  // When set, heads [tail_from, H) go here as (B, H - tail_from, L, D) and `out` holds (B, tail_from,
  // L, D): two arrays from one call (queries and keys), the angles computed once.
  void* out_tail = nullptr;
  int tail_from = 0;
};

void rms_norm_cpu(const RMSNormProblem& p);
void rope_cpu(const RoPEProblem& p);

}  // namespace mlx_h2o
