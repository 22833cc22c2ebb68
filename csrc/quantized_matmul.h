// quantized_matmul: y = x @ W^T over MLX's packed affine weights (the layout mx::quantize returns and
// nn.QuantizedLinear holds), for decode-sized x on the CPU: x's rows are quantized once to int8 per
// 32 values and dotted with the packed weights in integer arithmetic (kernels/int8_dot.h), threads
// over output columns. Larger x (prefill) and other streams run the composed definition,
// dequantize + matmul, which on the CPU is a BLAS GEMM.
#pragma once

#include <vector>

#include "mlx/ops.h"

#include "composed_primitive.h"

namespace mlx_h2o {

namespace mx = mlx::core;

/**
 * x (..., K) float32/float16/bfloat16; w (N, K * bits / 32) uint32; scales, biases (N, K / group_size)
 * of one float dtype; bits 4 or 8; group_size 32, 64 or 128. Returns (..., N) in the promoted dtype of
 * x and scales (as mx::quantized_matmul with transpose=true). The integer-dot kernel runs on CPU
 * streams for up to `max_rows` rows of x (default QMM_MAX_ROWS); otherwise dequantize + matmul.
 */
mx::array quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                           int group_size, int bits, int max_rows = -1, mx::StreamOrDevice s = {});

/** The same product from stock ops (dequantize, matmul): the kernel's definition and its fallback. */
mx::array quantized_matmul_composed(const mx::array& x, const mx::array& w, const mx::array& scales,
                                    const mx::array& biases, int group_size, int bits, mx::StreamOrDevice s = {});

/** W = (w, scales, biases) as a dense (N, K) array of `dtype` (bits 2-8, groups 32/64/128): on CPU
 *  streams one vectorized, threaded pass (MLX's dequantize is several times slower there). */
mx::array dequantize_affine(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size,
                            int bits, mx::Dtype dtype, mx::StreamOrDevice s = {});

class QuantizedMatmul : public ComposedPrimitive {
 public:
  QuantizedMatmul(mx::Stream stream, int group_size, int bits)
      : ComposedPrimitive(stream), group_size_(group_size), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::array> composed(const std::vector<mx::array>& inputs) override;

  const char* name() const override { return "QuantizedMatmulInt8"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  int group_size_, bits_;
};

}  // namespace mlx_h2o

namespace mlx_h2o {

class DequantizeAffine : public ComposedPrimitive {
 public:
  DequantizeAffine(mx::Stream stream, int group_size, int bits, mx::Dtype dtype = mx::float32)
      : ComposedPrimitive(stream), group_size_(group_size), bits_(bits), dtype_(dtype) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::array> composed(const std::vector<mx::array>& inputs) override;

  const char* name() const override { return "DequantizeAffine"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  int group_size_, bits_;
  mx::Dtype dtype_;
};

}  // namespace mlx_h2o
