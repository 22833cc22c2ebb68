#include "quantized_matmul.h"

#include <functional>
#include <stdexcept>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/fast.h"

#include "kernels/quantized_matmul_problem.h"
#include "exp_ops.h"
#include "norm_rope.h"
#include "op_utils.h"
#include "parallel.h"

namespace mlx_h2o {

namespace {

// Checks W = (w, scales, biases); returns K, the columns of W.
int check_weights(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size, int bits) {
  if (group_size != 32 && group_size != 64 && group_size != 128)
    fail("group_size must be one of 32, 64, 128, got " + std::to_string(group_size));
  if (w.ndim() != 2 || w.dtype() != mx::uint32)
    fail("w must be a 2-D uint32 array (N, K * bits / 32) as mx.quantize returns, got shape " + shape_str(w.shape()));
  if (scales.ndim() != 2 || scales.shape() != biases.shape())
    fail("scales and biases must be 2-D arrays of the same shape (N, K / group_size)");
  if (!is_float_dtype(scales.dtype()) || scales.dtype() != biases.dtype())
    fail("scales and biases must share one dtype among float32, float16, bfloat16");
  const int64_t bits_total = static_cast<int64_t>(w.shape(1)) * 32;
  const int K = bits_total % bits ? -1 : static_cast<int>(bits_total / bits);
  if (K < 0 || K % group_size != 0 || scales.shape(0) != w.shape(0) || scales.shape(1) != K / group_size)
    fail("scales " + shape_str(scales.shape()) + " do not match w " + shape_str(w.shape()) + " with bits " +
         std::to_string(bits) + " and group_size " + std::to_string(group_size) +
         " (do bits and group_size match the ones used to quantize?)");
  return K;
}

// Checks W for the dequantizing ops (dequantize_affine, quantized_embedding: bits 2-8); returns K.
int check_dequantized_weights(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size,
                              int bits) {
  if (bits < 2 || bits > 8 || bits == 7) fail("bits must be one of 2, 3, 4, 5, 6, 8, got " + std::to_string(bits));
  return check_weights(w, scales, biases, group_size, bits);
}

// Checks the arguments of quantized_matmul; returns K (x's last axis, or half of it for a packed
// gate/up product whose swiglu is the product's input).
int check_args(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
               int group_size, int bits, bool swiglu = false) {
  if (bits != 4 && bits != 8) fail("bits must be one of 4, 8, got " + std::to_string(bits));
  if (x.ndim() < 1) fail("x must have at least 1 dimension (..., K)");
  if (!is_float_dtype(x.dtype())) fail("x's dtype must be float32, float16 or bfloat16");
  if (swiglu && x.shape(-1) % 2) fail("with swiglu, x's last axis holds gate and up: it must be even, got " + shape_str(x.shape()));
  const int K = swiglu ? x.shape(-1) / 2 : x.shape(-1);
  if (static_cast<int64_t>(w.ndim() == 2 ? w.shape(1) : 0) * 32 != static_cast<int64_t>(K) * bits)
    fail("w's words per row do not hold K = " + std::to_string(K) + " " + std::to_string(bits) +
         "-bit values (x's last axis), w has shape " + shape_str(w.shape()));
  check_weights(w, scales, biases, group_size, bits);
  return K;
}

PackedWeights packed_weights(const mx::array& w, const mx::array& sc, const mx::array& bi, int group_size, int bits) {
  PackedWeights W;
  W.N = w.shape(0);
  W.K = static_cast<int>(static_cast<int64_t>(w.shape(1)) * 32 / bits);
  W.w = w.data<uint32_t>();
  W.scales = sc.data<void>();
  W.biases = bi.data<void>();
  W.scale_type = elem_type(sc.dtype());
  W.bits = bits;
  W.group_size = group_size;
  return W;
}

}  // namespace

mx::array dequantize_affine(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size,
                            int bits, mx::Dtype dtype, mx::StreamOrDevice s) {
  const int K = check_dequantized_weights(w, scales, biases, group_size, bits);
  if (!is_float_dtype(dtype)) fail("dtype must be float32, float16 or bfloat16");
  auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu)
    return mx::astype(mx::dequantize(w, scales, biases, group_size, bits, "affine", {}, std::nullopt, stream), dtype,
                      stream);
  return mx::array({w.shape(0), K}, dtype, std::make_shared<DequantizeAffine>(stream, group_size, bits, dtype),
                   {w, scales, biases});
}

mx::array quantized_embedding(const mx::array& indices, const mx::array& w, const mx::array& scales,
                              const mx::array& biases, int group_size, int bits, mx::StreamOrDevice s) {
  const int K = check_dequantized_weights(w, scales, biases, group_size, bits);
  if (indices.dtype() != mx::int32 && indices.dtype() != mx::uint32)
    fail("indices must be int32 or uint32 token ids");
  auto stream = mx::to_stream(s);
  mx::Shape shape = indices.shape();
  shape.push_back(K);
  if (stream.device != mx::Device::cpu || indices.size() == 0)
    return mx::astype(mx::dequantize(mx::take(w, indices, 0, stream), mx::take(scales, indices, 0, stream),
                                     mx::take(biases, indices, 0, stream), group_size, bits, "affine", {}, std::nullopt,
                                     stream),
                      scales.dtype(), stream);
  return mx::array(std::move(shape), scales.dtype(),
                   std::make_shared<DequantizeAffine>(stream, group_size, bits, scales.dtype(), true),
                   {w, scales, biases, indices});
}

mx::array quantized_matmul_composed(const mx::array& x, const mx::array& w, const mx::array& scales,
                                    const mx::array& biases, int group_size, int bits, mx::StreamOrDevice s) {
  check_args(x, w, scales, biases, group_size, bits);
  const auto dtype = mx::promote_types(x.dtype(), scales.dtype());
  auto dense = mx::dequantize(w, scales, biases, group_size, bits, "affine", {}, std::nullopt, s);
  return mx::matmul(mx::astype(x, dtype, s), mx::swapaxes(mx::astype(dense, dtype, s), 0, 1, s), s);
}

namespace {

// The swiglu or norm and the residual of a fused product as the ops they stand for, around `product`.
// fast_norm: the norm as mx.fast.rms_norm (the definition, which derivatives come from) rather than
// the extension's kernel (what long inputs run on the CPU).
mx::array fused_composed(const mx::array& x, bool swiglu, const std::optional<mx::array>& norm_weight,
                         std::optional<float> norm_eps, const std::optional<mx::array>& residual, bool fast_norm,
                         const std::function<mx::array(const mx::array&)>& product, mx::StreamOrDevice s) {
  auto input = swiglu     ? swiglu_halves(x, s)
               : norm_eps ? (fast_norm ? mx::fast::rms_norm(x, norm_weight, *norm_eps, s)
                                       : rms_norm(x, norm_weight, *norm_eps, s))
                          : x;
  auto y = product(input);
  return residual ? mx::add(*residual, y, s) : y;
}

}  // namespace

mx::array quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                           int group_size, int bits, int max_rows, const std::optional<mx::array>& norm_weight,
                           std::optional<float> norm_eps, const std::optional<mx::array>& residual, bool swiglu,
                           mx::StreamOrDevice s) {
  const int K = check_args(x, w, scales, biases, group_size, bits, swiglu);
  if (norm_weight && !norm_eps) fail("norm_weight needs norm_eps (the RMS norm fused into the product)");
  if (swiglu && norm_eps) fail("a product's input takes either the swiglu or the norm, not both");
  if (norm_weight && (norm_weight->ndim() != 1 || norm_weight->shape(0) != K || !is_float_dtype(norm_weight->dtype())))
    fail("norm_weight must be a float array of shape (K,) = (" + std::to_string(K) + ",), got " +
         shape_str(norm_weight->shape()));
  const auto x_dtype = norm_weight && norm_eps ? mx::promote_types(x.dtype(), norm_weight->dtype()) : x.dtype();
  const auto product_dtype = mx::promote_types(x_dtype, scales.dtype());
  mx::Shape shape = x.shape();
  shape.back() = w.shape(0);
  if (residual && (residual->shape() != shape || !is_float_dtype(residual->dtype())))
    fail("residual must be a float array of the product's shape " + shape_str(shape) + ", got " +
         shape_str(residual->shape()));
  auto stream = mx::to_stream(s);
  const int64_t rows = x.shape(-1) > 0 ? static_cast<int64_t>(x.size()) / x.shape(-1) : 0;
  if (max_rows < 0) max_rows = QMM_MAX_ROWS;
  if (stream.device != mx::Device::cpu || rows == 0 || w.shape(0) == 0 || rows > max_rows) {
    auto product = [&](const mx::array& xn) -> mx::array {
      if (stream.device != mx::Device::cpu || rows == 0 || w.shape(0) == 0)
        return quantized_matmul_composed(xn, w, scales, biases, group_size, bits, stream);
      // prefill: one dequantize pass, then the BLAS GEMM
      auto dense = dequantize_affine(w, scales, biases, group_size, bits, product_dtype, stream);
      return mx::matmul(mx::astype(xn, product_dtype, stream), mx::swapaxes(dense, 0, 1, stream), stream);
    };
    return fused_composed(x, swiglu, norm_weight, norm_eps, residual, false, product, stream);
  }
  ProductFusion fusion;
  fusion.swiglu = swiglu;
  fusion.norm = norm_eps.has_value();
  fusion.norm_weight = fusion.norm && norm_weight.has_value();
  fusion.norm_eps = norm_eps.value_or(0.0f);
  fusion.residual = residual.has_value();
  std::vector<mx::array> inputs = {x, w, scales, biases};
  if (fusion.norm_weight) inputs.push_back(*norm_weight);
  if (fusion.residual) inputs.push_back(*residual);
  const auto dtype = residual ? mx::promote_types(residual->dtype(), product_dtype) : product_dtype;
  return mx::array(std::move(shape), dtype, std::make_shared<QuantizedMatmul>(stream, group_size, bits, fusion),
                   std::move(inputs));
}

void QuantizedMatmul::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  const auto in = prepare_contiguous(inputs, outputs, enc);
  QuantizedMatmulProblem p;
  p.W = packed_weights(in[1], in[2], in[3], group_size_, bits_);
  p.M = static_cast<int>(in[0].size() / (fusion_.swiglu ? 2 * p.W.K : p.W.K));
  p.swiglu = fusion_.swiglu;
  p.x = in[0].data<void>();
  p.x_type = elem_type(in[0].dtype());
  p.out = outputs[0].data<void>();
  p.out_type = elem_type(outputs[0].dtype());
  p.threads = kernel_threads();
  size_t next = 4;
  auto normed_dtype = in[0].dtype();
  if (fusion_.norm) {
    p.norm = true;
    p.norm_eps = fusion_.norm_eps;
    if (fusion_.norm_weight) {
      const auto& weight = in[next++];
      p.norm_weight = weight.data<void>();
      p.norm_weight_type = elem_type(weight.dtype());
      normed_dtype = mx::promote_types(normed_dtype, weight.dtype());
    }
    p.norm_type = elem_type(normed_dtype);
  }
  if (fusion_.residual) {
    const auto& residual = in[next++];
    p.residual = residual.data<void>();
    p.residual_type = elem_type(residual.dtype());
    p.product_type = elem_type(mx::promote_types(normed_dtype, in[2].dtype()));
  }
  enc.dispatch([p]() { quantized_matmul_cpu(p); });
}

void QuantizedMatmul::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[quantized_matmul] no GPU kernel; the op uses the composed path on GPU streams");
}

std::vector<mx::array> QuantizedMatmul::composed(const std::vector<mx::array>& inputs) {
  size_t next = 4;
  std::optional<mx::array> norm_weight, residual;
  if (fusion_.norm_weight) norm_weight = inputs[next++];
  if (fusion_.residual) residual = inputs[next++];
  const std::optional<float> norm_eps = fusion_.norm ? std::optional<float>(fusion_.norm_eps) : std::nullopt;
  auto product = [&](const mx::array& x) {
    return quantized_matmul_composed(x, inputs[1], inputs[2], inputs[3], group_size_, bits_, stream());
  };
  return {fused_composed(inputs[0], fusion_.swiglu, norm_weight, norm_eps, residual, true, product, stream())};
}

bool QuantizedMatmul::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const QuantizedMatmul&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_ && fusion_ == o.fusion_;
}

std::vector<mx::Shape> QuantizedMatmul::output_shapes(const std::vector<mx::array>& inputs) {
  mx::Shape shape = inputs[0].shape();
  shape.back() = inputs[1].shape(0);
  return {shape};
}

}  // namespace mlx_h2o

namespace mlx_h2o {

void DequantizeAffine::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  const auto in = prepare_contiguous(inputs, outputs, enc);
  DequantizeProblem p;
  p.W = packed_weights(in[0], in[1], in[2], group_size_, bits_);
  p.out = outputs[0].data<void>();
  p.out_type = elem_type(outputs[0].dtype());
  p.threads = kernel_threads();
  if (lookup_) {
    p.rows = in[3].data<void>();
    p.rows_unsigned = in[3].dtype() == mx::uint32;
    p.n_rows = static_cast<int64_t>(in[3].size());
  }
  enc.dispatch([p]() { dequantize_cpu(p); });
}

void DequantizeAffine::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[dequantize_affine] no GPU kernel; the op uses mx::dequantize on GPU streams");
}

std::vector<mx::array> DequantizeAffine::composed(const std::vector<mx::array>& inputs) {
  auto row = [&](int i) { return lookup_ ? mx::take(inputs[i], inputs[3], 0, stream()) : inputs[i]; };
  auto dense = mx::dequantize(row(0), row(1), row(2), group_size_, bits_, "affine", {}, std::nullopt, stream());
  return {mx::astype(dense, dtype_, stream())};
}

bool DequantizeAffine::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const DequantizeAffine&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_ && dtype_ == o.dtype_ && lookup_ == o.lookup_;
}

std::vector<mx::Shape> DequantizeAffine::output_shapes(const std::vector<mx::array>& inputs) {
  const int K = static_cast<int>(static_cast<int64_t>(inputs[0].shape(1)) * 32 / bits_);
  if (!lookup_) return {{inputs[0].shape(0), K}};
  mx::Shape shape = inputs[3].shape();
  shape.push_back(K);
  return {shape};
}

}  // namespace mlx_h2o
