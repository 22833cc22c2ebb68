#include "norm_rope.h"

#include <stdexcept>
#include <utility>

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

namespace {

// The heads of x (B, L, H * head_dim) as (B, H, L, head_dim), split into the groups, the first
// `rotated` through mx.fast.rope, each cast to its dtype: split_heads_rope's definition.
std::vector<mx::array> split_heads_rope_composed(const mx::array& x, const std::vector<int>& heads, int head_dim,
                                                 int rotated, int dims, bool traditional, float base, float scale,
                                                 int offset, const std::vector<mx::Dtype>& dtypes,
                                                 mx::StreamOrDevice s) {
  int total = 0;
  mx::Shape bounds;
  for (size_t i = 0; i < heads.size(); ++i) {
    if (i) bounds.push_back(total);
    total += heads[i];
  }
  auto all = mx::transpose(mx::reshape(x, {x.shape(0), x.shape(1), total, head_dim}, s), {0, 2, 1, 3}, s);
  auto groups = mx::split(all, bounds, 1, s);
  for (int i = 0; i < rotated; ++i)
    groups[i] = mx::fast::rope(groups[i], dims, traditional, base, scale, offset, std::nullopt, s);
  for (size_t i = 0; i < groups.size(); ++i)
    if (groups[i].dtype() != dtypes[i]) groups[i] = mx::astype(groups[i], dtypes[i], s);
  return groups;
}

}  // namespace

std::vector<mx::array> split_heads_rope(const mx::array& x, const std::vector<int>& heads, int head_dim, int rotated,
                                        int dims, bool traditional, float base, float scale, int offset,
                                        const std::vector<mx::Dtype>& dtypes, mx::StreamOrDevice s) {
  if (x.ndim() != 3 || !is_float_dtype(x.dtype()))
    fail("x must be a float32, float16 or bfloat16 array (B, L, heads * head_dim), got shape " + shape_str(x.shape()));
  if (heads.empty()) fail("heads must name at least one group of heads");
  int64_t total = 0;
  for (int h : heads) {
    if (h < 1) fail("every group must have at least one head");
    total += h;
  }
  if (head_dim < 1 || total * head_dim != x.shape(2))
    fail("x's last axis (" + std::to_string(x.shape(2)) + ") is not sum(heads) * head_dim = " +
         std::to_string(total) + " * " + std::to_string(head_dim));
  if (rotated < 0 || rotated > static_cast<int>(heads.size()))
    fail("rotated must be in [0, " + std::to_string(heads.size()) + "], got " + std::to_string(rotated));
  if (dims < 2 || dims % 2 || dims > head_dim)
    fail("dims must be even and in [2, head_dim = " + std::to_string(head_dim) + "], got " + std::to_string(dims));
  if (!dtypes.empty() && dtypes.size() != heads.size())
    fail("dtypes must be empty or give one dtype per group (" + std::to_string(heads.size()) + "), got " +
         std::to_string(dtypes.size()));
  for (const auto& d : dtypes) {
    if (!is_float_dtype(d)) fail("every group's dtype must be float32, float16 or bfloat16");
    // The kernel rounds its float32 result once: the bits of a cast where x is float32, not of a
    // group first rounded to a 16-bit x's dtype and then cast.
    if (d != x.dtype() && x.dtype() != mx::float32) fail("groups in another dtype than x's need float32 x");
  }
  auto out_dtypes = dtypes.empty() ? std::vector<mx::Dtype>(heads.size(), x.dtype()) : dtypes;
  auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu || x.size() == 0)
    return split_heads_rope_composed(x, heads, head_dim, rotated, dims, traditional, base, scale, offset, out_dtypes,
                                     stream);
  std::vector<mx::Shape> shapes;
  for (int h : heads) shapes.push_back({x.shape(0), h, x.shape(1), head_dim});
  return mx::array::make_arrays(std::move(shapes), out_dtypes,
                                std::make_shared<SplitHeadsRoPE>(stream, heads, head_dim, rotated, dims, traditional,
                                                                 base, scale, offset, out_dtypes),
                                {x});
}

void SplitHeadsRoPE::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  const auto in = prepare_contiguous(inputs, outputs, enc);
  const auto& x = in[0];
  // x (B, L, total * D) read as (B, total, L, D): one RoPE problem per run of groups, the rotated
  // groups' first two in one call (queries and keys: the angles computed once).
  auto problem = [&](int first_head, int n_heads, int dims, mx::array& out) {
    RoPEProblem p;
    p.B = x.shape(0);
    p.H = n_heads;
    p.L = x.shape(1);
    p.D = head_dim_;
    p.dims = dims;
    p.x.data = static_cast<const char*>(x.data<void>()) + static_cast<int64_t>(first_head) * head_dim_ * x.itemsize();
    p.x.type = elem_type(x.dtype());
    p.x.stride[0] = static_cast<int64_t>(x.shape(1)) * x.shape(2);
    p.x.stride[1] = head_dim_;
    p.x.stride[2] = x.shape(2);
    p.x.stride[3] = 1;
    p.traditional = traditional_;
    p.base = base_;
    p.scale = scale_;
    p.offset = offset_;
    p.out = out.data<void>();
    p.out_type = elem_type(out.dtype());  // the kernel computes in float32 and rounds once to it
    return p;
  };
  std::vector<RoPEProblem> problems;
  int head = 0;
  for (size_t i = 0; i < heads_.size(); ++i) {
    const bool rotate = static_cast<int>(i) < rotated_;
    // this group and the next in one call (where they share a dtype)
    if (rotate && i + 1 < heads_.size() && static_cast<int>(i + 1) < rotated_ &&
        outputs[i].dtype() == outputs[i + 1].dtype()) {
      auto p = problem(head, heads_[i] + heads_[i + 1], dims_, outputs[i]);
      p.out_tail = outputs[i + 1].data<void>();
      p.tail_from = heads_[i];
      problems.push_back(p);
      head += heads_[i] + heads_[i + 1];
      ++i;
      continue;
    }
    problems.push_back(problem(head, heads_[i], rotate ? dims_ : 0, outputs[i]));
    head += heads_[i];
  }
  enc.dispatch([problems = std::move(problems)]() {
    for (const auto& p : problems) rope_cpu(p);
  });
}

void SplitHeadsRoPE::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[split_heads_rope] no GPU kernel; the op uses reshape, split and mx.fast.rope on GPU streams");
}

std::vector<mx::array> SplitHeadsRoPE::composed(const std::vector<mx::array>& inputs) {
  return split_heads_rope_composed(inputs[0], heads_, head_dim_, rotated_, dims_, traditional_, base_, scale_, offset_,
                                   dtypes_, stream());
}

bool SplitHeadsRoPE::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const SplitHeadsRoPE&>(other);
  return heads_ == o.heads_ && head_dim_ == o.head_dim_ && rotated_ == o.rotated_ && dims_ == o.dims_ &&
         traditional_ == o.traditional_ && base_ == o.base_ && scale_ == o.scale_ && offset_ == o.offset_ &&
         dtypes_ == o.dtypes_;
}

std::vector<mx::Shape> SplitHeadsRoPE::output_shapes(const std::vector<mx::array>& inputs) {
  std::vector<mx::Shape> shapes;
  for (int h : heads_) shapes.push_back({inputs[0].shape(0), h, inputs[0].shape(1), head_dim_});
  return shapes;
}

}  // namespace mlx_h2o
