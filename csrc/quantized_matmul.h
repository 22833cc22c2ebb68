// quantized_matmul: y = x @ W^T over MLX's packed affine weights (the layout mx::quantize returns and
// nn.QuantizedLinear holds), for decode-sized x on the CPU: x's rows are quantized once to int8 per
// 32 values and dotted with the packed weights in integer arithmetic (kernels/int8_dot.h), threads
// over output columns. Larger float32 x (prefill) takes a BLAS GEMM over W dequantized a block of rows
// at a time, in the same primitive; other dtypes and streams run the composed definition, dequantize
// + matmul.
#pragma once

#include <optional>
#include <vector>

#include "mlx/ops.h"

#include "composed_primitive.h"

namespace mlx_h2o {

namespace mx = mlx::core;

/**
 * x (..., K) float32/float16/bfloat16; w (N, K * bits / 32) uint32; scales, biases (N, K / group_size)
 * of one float dtype; bits 4 or 8; group_size 32, 64 or 128. Returns (..., N) in the promoted dtype of
 * x and scales (as mx::quantized_matmul with transpose=true). The integer-dot kernel runs on CPU
 * streams for up to `max_rows` rows of x (default QMM_MAX_ROWS); otherwise dequantize + matmul: for
 * float32 (x, residual and the product) one primitive that dequantizes W a block of rows at a time
 * into scratch and multiplies each block with the GEMM MLX's matmul calls (cblas_sgemm), with the
 * fused ops below applied as their own kernels would, so the same bits as the ops one by one up to
 * the GEMM's blocking; the whole W is never dense at once (a prefill's peak memory).
 *
 * The ops around a decoder layer's products can come in the same primitive (each primitive costs a
 * 2-core decode step ~8 us of dispatch, docs/cpu-decode.md), with the bits of the ops one by one:
 * - norm_eps given: x is first replaced by mx.fast.rms_norm(x, norm_weight, norm_eps) (norm_weight
 *   (K,) or none), e.g. a block's input norm before its packed q/k/v product;
 * - swiglu: x (..., 2K) is a packed gate/up product and the product is of its swiglu, silu(gate) *
 *   up (the swiglu_halves op), e.g. a SwiGLU MLP's down projection;
 * - residual (..., N), the product's shape: the result is residual + x @ W^T, e.g. the residual
 *   stream plus o_proj's or down_proj's output;
 * - swiglu_output: the result is swiglu_halves of the product, (..., N / 2), e.g. a packed gate/up
 *   product's activation (the GEMM writes it a block of columns at a time, never the (..., N) product;
 *   shorter x runs the product, then swiglu_halves).
 */
mx::array quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                           int group_size, int bits, int max_rows = -1,
                           const std::optional<mx::array>& norm_weight = std::nullopt,
                           std::optional<float> norm_eps = std::nullopt,
                           const std::optional<mx::array>& residual = std::nullopt, bool swiglu = false,
                           bool swiglu_output = false, mx::StreamOrDevice s = {});

/** The same product from stock ops (dequantize, matmul): the kernel's definition and its fallback. */
mx::array quantized_matmul_composed(const mx::array& x, const mx::array& w, const mx::array& scales,
                                    const mx::array& biases, int group_size, int bits, mx::StreamOrDevice s = {});

/** W = (w, scales, biases) as a dense (N, K) array of `dtype` (bits 2-8, groups 32/64/128): on CPU
 *  streams one vectorized, threaded pass (MLX's dequantize is several times slower there). */
mx::array dequantize_affine(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size,
                            int bits, mx::Dtype dtype, mx::StreamOrDevice s = {});

/** A product's fused extras (quantized_matmul's swiglu / norm_weight / norm_eps / residual), and so
 *  which inputs follow x, w, scales, biases. */
struct ProductFusion {
  bool swiglu = false, norm = false, norm_weight = false, residual = false, swiglu_output = false;
  float norm_eps = 0.0f;
  bool operator==(const ProductFusion& o) const {
    return swiglu == o.swiglu && norm == o.norm && norm_weight == o.norm_weight && residual == o.residual &&
           swiglu_output == o.swiglu_output && norm_eps == o.norm_eps;
  }
};

/** An embedding lookup in packed affine weights (nn.QuantizedEmbedding's call): W's rows at `indices`
 *  (any shape, int32 or uint32; negative int32 indices count from the end) as (*indices.shape, K) in
 *  the scales' dtype, as mx.dequantize(w[indices], scales[indices], biases[indices]). On CPU streams one
 *  primitive (the gathers and MLX's composed dequantize are ~36); an index outside W's rows gives a row
 *  of NaN (MLX leaves that undefined). */
mx::array quantized_embedding(const mx::array& indices, const mx::array& w, const mx::array& scales,
                              const mx::array& biases, int group_size, int bits, mx::StreamOrDevice s = {});

class QuantizedMatmul : public ComposedPrimitive {
 public:
  // max_rows: up to which rows of x eval_cpu runs the integer-dot kernel; above it, the blocked GEMM.
  QuantizedMatmul(mx::Stream stream, int group_size, int bits, ProductFusion fusion, int max_rows)
      : ComposedPrimitive(stream), group_size_(group_size), bits_(bits), fusion_(fusion), max_rows_(max_rows) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::array> composed(const std::vector<mx::array>& inputs) override;

  const char* name() const override { return "QuantizedMatmulInt8"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  int group_size_, bits_;
  ProductFusion fusion_;
  int max_rows_;
};

}  // namespace mlx_h2o

namespace mlx_h2o {

/** W dequantized, all of its rows, or (with `lookup`) the rows named by a last input of indices. */
class DequantizeAffine : public ComposedPrimitive {
 public:
  DequantizeAffine(mx::Stream stream, int group_size, int bits, mx::Dtype dtype = mx::float32, bool lookup = false)
      : ComposedPrimitive(stream), group_size_(group_size), bits_(bits), dtype_(dtype), lookup_(lookup) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::array> composed(const std::vector<mx::array>& inputs) override;

  const char* name() const override { return "DequantizeAffine"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  int group_size_, bits_;
  mx::Dtype dtype_;
  bool lookup_;
};

}  // namespace mlx_h2o
