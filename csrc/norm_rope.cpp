#include "norm_rope.h"

#include <stdexcept>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/fast.h"

#include "kernels/norm_rope_problem.h"
#include "op_utils.h"

namespace mlx_h2o {

mx::array rms_norm(const mx::array& x, const std::optional<mx::array>& weight, float eps, mx::StreamOrDevice s) {
  if (x.ndim() < 1 || !is_float_dtype(x.dtype())) fail("x must be a float32, float16 or bfloat16 array (..., D)");
  if (weight && (weight->ndim() != 1 || weight->shape(0) != x.shape(-1) || !is_float_dtype(weight->dtype())))
    fail("weight must be a float array of shape (D,) = (" + std::to_string(x.shape(-1)) + ",), got " +
         shape_str(weight->shape()));
  auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu || x.size() == 0) return mx::fast::rms_norm(x, weight, eps, stream);
  const auto dtype = weight ? mx::promote_types(x.dtype(), weight->dtype()) : x.dtype();
  std::vector<mx::array> inputs = {x};
  if (weight) inputs.push_back(*weight);
  return mx::array(x.shape(), dtype, std::make_shared<RMSNormCPU>(stream, eps, weight.has_value()), inputs);
}

void RMSNormCPU::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  const auto in = prepare_contiguous(inputs, outputs, enc);
  RMSNormProblem p;
  p.D = in[0].shape(-1);
  p.rows = static_cast<int>(in[0].size() / p.D);
  p.x = in[0].data<void>();
  p.x_type = elem_type(in[0].dtype());
  if (has_weight_) {
    p.weight = in[1].data<void>();
    p.weight_type = elem_type(in[1].dtype());
    p.weight_stride = 1;
  }
  p.eps = eps_;
  p.out = outputs[0].data<void>();
  p.out_type = elem_type(outputs[0].dtype());
  enc.dispatch([p]() { rms_norm_cpu(p); });
}

void RMSNormCPU::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[rms_norm] no GPU kernel; the op uses mx.fast.rms_norm on GPU streams");
}

std::vector<mx::array> RMSNormCPU::composed(const std::vector<mx::array>& inputs) {
  std::optional<mx::array> weight;
  if (has_weight_) weight = inputs[1];
  return {mx::fast::rms_norm(inputs[0], weight, eps_, stream())};
}

bool RMSNormCPU::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const RMSNormCPU&>(other);
  return eps_ == o.eps_ && has_weight_ == o.has_weight_;
}

mx::array rope(const mx::array& x, int dims, bool traditional, float base, float scale, int offset,
               mx::StreamOrDevice s) {
  if ((x.ndim() != 3 && x.ndim() != 4) || !is_float_dtype(x.dtype()))
    fail("x must be a float32, float16 or bfloat16 array (B, H, L, D) or (B, L, D), got shape " + shape_str(x.shape()));
  if (dims < 2 || dims % 2 || dims > x.shape(-1))
    fail("dims must be even and in [2, D = " + std::to_string(x.shape(-1)) + "], got " + std::to_string(dims));
  auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu || x.size() == 0)
    return mx::fast::rope(x, dims, traditional, base, scale, offset, std::nullopt, stream);
  return mx::array(x.shape(), x.dtype(), std::make_shared<RoPECPU>(stream, dims, traditional, base, scale, offset), {x});
}

void RoPECPU::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  const auto& x = inputs[0];
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  enc.set_input_array(x);
  enc.set_output_array(out);
  RoPEProblem p;
  const bool three = x.ndim() == 3;  // (B, L, D) as (B, 1, L, D)
  p.B = x.shape(0);
  p.H = three ? 1 : x.shape(1);
  p.L = x.shape(-2);
  p.D = x.shape(-1);
  p.dims = dims_;
  p.x.data = x.data<void>();
  p.x.type = elem_type(x.dtype());
  p.x.stride[0] = x.strides()[0];
  p.x.stride[1] = three ? 0 : x.strides()[1];
  p.x.stride[2] = x.strides()[x.ndim() - 2];
  p.x.stride[3] = x.strides()[x.ndim() - 1];
  p.traditional = traditional_;
  p.base = base_;
  p.scale = scale_;
  p.offset = offset_;
  p.out = out.data<void>();
  p.out_type = elem_type(out.dtype());
  enc.dispatch([p]() { rope_cpu(p); });
}

void RoPECPU::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[rope] no GPU kernel; the op uses mx.fast.rope on GPU streams");
}

std::vector<mx::array> RoPECPU::composed(const std::vector<mx::array>& inputs) {
  return {mx::fast::rope(inputs[0], dims_, traditional_, base_, scale_, offset_, std::nullopt, stream())};
}

bool RoPECPU::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const RoPECPU&>(other);
  return dims_ == o.dims_ && traditional_ == o.traditional_ && base_ == o.base_ && scale_ == o.scale_ &&
         offset_ == o.offset_;
}

}  // namespace mlx_h2o
