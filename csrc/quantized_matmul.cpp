#include "quantized_matmul.h"

#include <stdexcept>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

#include "kernels/quantized_matmul_problem.h"
#include "op_utils.h"
#include "parallel.h"

namespace mlx_h2o {

namespace {

// Checks the arguments; returns K (x's last axis).
int check_args(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
               int group_size, int bits) {
  if (bits != 4 && bits != 8) fail("bits must be one of 4, 8, got " + std::to_string(bits));
  if (group_size != 32 && group_size != 64 && group_size != 128)
    fail("group_size must be one of 32, 64, 128, got " + std::to_string(group_size));
  if (x.ndim() < 1) fail("x must have at least 1 dimension (..., K)");
  if (!is_float_dtype(x.dtype())) fail("x's dtype must be float32, float16 or bfloat16");
  if (w.ndim() != 2 || w.dtype() != mx::uint32)
    fail("w must be a 2-D uint32 array (N, K * bits / 32) as mx.quantize returns, got shape " + shape_str(w.shape()));
  if (scales.ndim() != 2 || scales.shape() != biases.shape())
    fail("scales and biases must be 2-D arrays of the same shape (N, K / group_size)");
  if (!is_float_dtype(scales.dtype()) || scales.dtype() != biases.dtype())
    fail("scales and biases must share one dtype among float32, float16, bfloat16");
  const int K = x.shape(-1);
  if (static_cast<int64_t>(w.shape(1)) * 32 != static_cast<int64_t>(K) * bits)
    fail("w's " + std::to_string(w.shape(1)) + " words per row do not hold K = " + std::to_string(K) + " " +
         std::to_string(bits) + "-bit values (x's last axis)");
  if (K % group_size != 0 || scales.shape(0) != w.shape(0) || scales.shape(1) != K / group_size)
    fail("scales " + shape_str(scales.shape()) + " do not match w " + shape_str(w.shape()) + " with group_size " +
         std::to_string(group_size) + " (do bits and group_size match the ones used to quantize?)");
  return K;
}

}  // namespace

mx::array quantized_matmul_composed(const mx::array& x, const mx::array& w, const mx::array& scales,
                                    const mx::array& biases, int group_size, int bits, mx::StreamOrDevice s) {
  check_args(x, w, scales, biases, group_size, bits);
  const auto dtype = mx::promote_types(x.dtype(), scales.dtype());
  auto dense = mx::dequantize(w, scales, biases, group_size, bits, "affine", {}, std::nullopt, s);
  return mx::matmul(mx::astype(x, dtype, s), mx::swapaxes(mx::astype(dense, dtype, s), 0, 1, s), s);
}

mx::array quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                           int group_size, int bits, int max_rows, mx::StreamOrDevice s) {
  const int K = check_args(x, w, scales, biases, group_size, bits);
  auto stream = mx::to_stream(s);
  const int64_t rows = K > 0 ? static_cast<int64_t>(x.size()) / K : 0;
  if (max_rows < 0) max_rows = QMM_MAX_ROWS;
  if (stream.device != mx::Device::cpu || rows > max_rows || rows == 0 || w.shape(0) == 0)
    return quantized_matmul_composed(x, w, scales, biases, group_size, bits, stream);
  mx::Shape shape = x.shape();
  shape.back() = w.shape(0);
  return mx::array(std::move(shape), mx::promote_types(x.dtype(), scales.dtype()),
                   std::make_shared<QuantizedMatmul>(stream, group_size, bits), {x, w, scales, biases});
}

void QuantizedMatmul::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  std::vector<mx::array> in = inputs;
  // The kernel reads every input as row-contiguous.
  for (auto& a : in)
    if (!a.flags().row_contiguous) a = contiguous_copy(a, enc);
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  QuantizedMatmulProblem p;
  const auto &x = in[0], &w = in[1], &sc = in[2], &bi = in[3];
  p.K = x.shape(-1);
  p.M = static_cast<int>(x.size() / p.K);
  p.N = w.shape(0);
  p.x = x.data<void>();
  p.x_type = elem_type(x.dtype());
  p.w = w.data<uint32_t>();
  p.scales = sc.data<void>();
  p.biases = bi.data<void>();
  p.scale_type = elem_type(sc.dtype());
  p.bits = bits_;
  p.group_size = group_size_;
  p.out = out.data<void>();
  p.out_type = elem_type(out.dtype());
  p.threads = kernel_threads();
  for (auto& a : in) enc.set_input_array(a);
  enc.set_output_array(out);
  enc.dispatch([p]() { quantized_matmul_cpu(p); });
}

void QuantizedMatmul::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[quantized_matmul] no GPU kernel; the op uses the composed path on GPU streams");
}

std::vector<mx::array> QuantizedMatmul::composed(const std::vector<mx::array>& inputs) {
  return {quantized_matmul_composed(inputs[0], inputs[1], inputs[2], inputs[3], group_size_, bits_, stream())};
}

bool QuantizedMatmul::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const QuantizedMatmul&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_;
}

std::vector<mx::Shape> QuantizedMatmul::output_shapes(const std::vector<mx::array>& inputs) {
  mx::Shape shape = inputs[0].shape();
  shape.back() = inputs[1].shape(0);
  return {shape};
}

}  // namespace mlx_h2o
