// Plain-data description of one y = x @ W^T over MLX's packed affine weights for the CPU kernels (no
// MLX types: the kernels are compiled once per instruction set, see isa_variants.inc).
#pragma once

#include <cstdint>

#include "elem_type.h"

namespace mlx_h2o {

/** W (N, K) in MLX's affine format: w = scale * q + bias per group of `group_size` columns, q packed
 *  little-endian, `bits` bits each, in uint32 words. Every array row-contiguous. */
struct PackedWeights {
  int N = 0, K = 0;
  const uint32_t* w = nullptr;   // (N, K * bits / 32)
  const void* scales = nullptr;  // (N, K / group_size)
  const void* biases = nullptr;  // (N, K / group_size)
  ElemType scale_type = ElemType::float32;
  int bits = 4, group_size = 32;
};

/** y (M, N) = x (M, K) @ W^T, both row-contiguous. Optionally with the ops around a decoder layer's
 *  products fused in, each rounded as the op on its own would round it:
 *  - `norm`: x replaced by rms_norm(x, norm_weight, norm_eps) (RMSNormProblem's arithmetic),
 *    rounded to norm_type, before it is quantized: one pass over x where the norm was an op of its own;
 *  - `swiglu`: x is (M, 2K), a packed gate/up product, and the product is of silu(gate) * up (the
 *    swiglu kernel's arithmetic), rounded to x_type: the activation of a SwiGLU MLP inside its
 *    down projection;
 *  - `residual` (M, N) row-contiguous: out = residual + y, y first rounded to product_type. */
struct QuantizedMatmulProblem {
  PackedWeights W;
  int M = 0;
  const void* x = nullptr;
  ElemType x_type = ElemType::float32;
  void* out = nullptr;
  ElemType out_type = ElemType::float32;
  int threads = 1;
  bool swiglu = false;
  bool norm = false;
  const void* norm_weight = nullptr;  // (K,) or null
  ElemType norm_weight_type = ElemType::float32;
  float norm_eps = 1e-5f;
  ElemType norm_type = ElemType::float32;
  const void* residual = nullptr;
  ElemType residual_type = ElemType::float32;
  ElemType product_type = ElemType::float32;
};

/** out (N, K) row-contiguous = W dequantized (bits 2-8, groups 32/64/128). With `rows` (an embedding
 *  lookup): out (n_rows, K) = W's rows rows[i], int32 (negative ones from the end, as mx.take) or
 *  uint32; an index outside W's rows gives a row of NaN. */
struct DequantizeProblem {
  PackedWeights W;
  void* out = nullptr;
  ElemType out_type = ElemType::float32;
  int threads = 1;
  const void* rows = nullptr;
  bool rows_unsigned = false;
  int64_t n_rows = 0;
};

/** The integer-dot kernel's formats: bits 4 or 8, group sizes 32, 64 or 128 (multiples of the
 *  32-value blocks the activations are quantized in), up to QMM_MAX_ROWS rows of x. Above that one
 *  dequantize pass + a GEMM is cheaper: measured on SmolLM2-135M's decode step (2-core x86, AVX2),
 *  the kernel takes 0.50x the step of dequantize + GEMM at 12 rows, 0.53x at 16, 0.73x at 32, 1.31x at 64
 *  (benchmarks/bench_batch_rows.py --kernel-max-rows 8 100000). */
constexpr int QMM_MAX_ROWS = 32;

/** y = x @ W^T: each row of x quantized once to int8 per 32 values (scale max|x| / 127), integer dot
 *  products against the packed weights, one float scale per (weight group, activation block) and the
 *  bias term from the exact per-group sums of x. Threads split the output columns. */
void quantized_matmul_cpu(const QuantizedMatmulProblem& p);

/** W as floats, vectorized and threaded over rows: what feeds the GEMM for long x (prefill). */
void dequantize_cpu(const DequantizeProblem& p);

}  // namespace mlx_h2o
