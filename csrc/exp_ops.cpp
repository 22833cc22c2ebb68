#include "exp_ops.h"

#include <stdexcept>

#include "mlx/backend/cpu/encoder.h"

#include "kernels/exp_ops_problem.h"
#include "op_utils.h"

namespace mlx_h2o {

static mx::array swiglu_composed(const mx::array& gate, const mx::array& up, mx::StreamOrDevice s) {
  return mx::multiply(mx::multiply(gate, mx::sigmoid(gate, s), s), up, s);
}

mx::array swiglu(const mx::array& gate, const mx::array& up, mx::StreamOrDevice s) {
  if (!is_float_dtype(gate.dtype()) || gate.dtype() != up.dtype())
    fail("gate and up must be float32, float16 or bfloat16 arrays of one dtype");
  if (gate.shape() != up.shape())
    fail("gate and up must have one shape, got " + shape_str(gate.shape()) + " and " + shape_str(up.shape()));
  auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu || gate.size() == 0) return swiglu_composed(gate, up, stream);
  return mx::array(gate.shape(), gate.dtype(), std::make_shared<SwiGLUCPU>(stream), {gate, up});
}

// The gate and up halves of x's last axis, as views.
static std::vector<mx::array> halves(const mx::array& x, mx::StreamOrDevice s) {
  return mx::split(x, 2, -1, s);
}

mx::array swiglu_halves(const mx::array& x, mx::StreamOrDevice s) {
  if (!is_float_dtype(x.dtype()) || x.ndim() < 1 || x.shape(-1) == 0 || x.shape(-1) % 2 != 0)
    fail("x must be a float32, float16 or bfloat16 array whose last axis holds gate and up (even, not zero), got " +
         shape_str(x.shape()));
  auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu || x.size() == 0) {
    auto gu = halves(x, stream);
    return swiglu_composed(gu[0], gu[1], stream);
  }
  auto shape = x.shape();
  shape.back() /= 2;
  return mx::array(std::move(shape), x.dtype(), std::make_shared<SwiGLUCPU>(stream, true), {x});
}

std::vector<mx::Shape> SwiGLUCPU::output_shapes(const std::vector<mx::array>& inputs) {
  auto shape = inputs[0].shape();
  if (halves_) shape.back() /= 2;
  return {shape};
}

void SwiGLUCPU::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  const auto in = prepare_contiguous(inputs, outputs, enc);
  SwiGLUProblem p;
  p.gate = in[0].data<void>();
  p.type = elem_type(in[0].dtype());
  p.out = outputs[0].data<void>();
  if (halves_) {  // each row of x: its gate, then its up
    p.n = in[0].shape(-1) / 2;
    p.ld = 2 * p.n;
    p.rows = static_cast<int64_t>(in[0].size()) / p.ld;
    p.up = static_cast<const char*>(p.gate) + p.n * in[0].itemsize();
  } else {
    p.n = p.ld = static_cast<int64_t>(in[0].size());
    p.up = in[1].data<void>();
  }
  enc.dispatch([p]() { swiglu_cpu(p); });
}

void SwiGLUCPU::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[swiglu] no GPU kernel; the op uses the stock ops on GPU streams");
}

std::vector<mx::array> SwiGLUCPU::composed(const std::vector<mx::array>& inputs) {
  if (halves_) {
    auto gu = halves(inputs[0], stream());
    return {swiglu_composed(gu[0], gu[1], stream())};
  }
  return {swiglu_composed(inputs[0], inputs[1], stream())};
}

mx::array logsumexp_last_axis(const mx::array& x, mx::StreamOrDevice s) {
  if (x.ndim() < 1 || !is_float_dtype(x.dtype()) || x.shape(-1) == 0)
    fail("x must be a float32, float16 or bfloat16 array with a non-empty last axis, got shape " + shape_str(x.shape()));
  auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu || x.size() == 0) return mx::logsumexp(x, -1, false, stream);
  auto shape = x.shape();
  shape.pop_back();
  return mx::array(shape, x.dtype(), std::make_shared<LogSumExpCPU>(stream), {x});
}

void LogSumExpCPU::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  const auto in = prepare_contiguous(inputs, outputs, enc);
  LogSumExpProblem p;
  p.M = in[0].shape(-1);
  p.rows = static_cast<int64_t>(in[0].size()) / p.M;
  p.x = in[0].data<void>();
  p.type = elem_type(in[0].dtype());
  p.out = outputs[0].data<void>();
  enc.dispatch([p]() { logsumexp_cpu(p); });
}

void LogSumExpCPU::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[logsumexp] no GPU kernel; the op uses mx.logsumexp on GPU streams");
}

std::vector<mx::array> LogSumExpCPU::composed(const std::vector<mx::array>& inputs) {
  return {mx::logsumexp(inputs[0], -1, false, stream())};
}

}  // namespace mlx_h2o
