#include "accumulate_prefix.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

#include "op_utils.h"

namespace mlx_h2o {

void check_accumulate(const mx::array& acc, const mx::array& x, int held) {
  if (acc.dtype() != mx::float32 || x.dtype() != mx::float32) fail("acc and x must be float32 arrays");
  if (acc.ndim() < 1 || x.ndim() != acc.ndim())
    fail("acc (..., C) and x (..., N) must have the same number of dimensions (at least 1), got " +
         shape_str(acc.shape()) + " and " + shape_str(x.shape()));
  for (int d = 0; d + 1 < static_cast<int>(acc.ndim()); ++d)
    if (acc.shape(d) != x.shape(d))
      fail("x must have acc's leading shape: acc " + shape_str(acc.shape()) + ", x " + shape_str(x.shape()));
  const int C = acc.shape(-1), N = x.shape(-1);
  if (N > C) fail("x has " + std::to_string(N) + " entries along the last axis, more than acc's " + std::to_string(C));
  if (held < 0 || held > C) fail("held must be in [0, " + std::to_string(C) + "], got " + std::to_string(held));
}

void accumulate_prefix_rows(const float* acc, const float* x, float* out, int64_t rows, int64_t C, int64_t N, int64_t held,
                            float alpha, float beta) {
  held = std::min(held, N);
  for (int64_t r = 0; r < rows; ++r) {
    const float* ar = acc + r * C;
    const float* xr = x + r * N;
    float* orow = out + r * C;
    if (orow != ar) std::memcpy(orow + N, ar + N, (C - N) * sizeof(float));
    for (int64_t i = 0; i < held; ++i) orow[i] = alpha * ar[i] + beta * xr[i];
    for (int64_t i = held; i < N; ++i) orow[i] = beta * xr[i];
  }
}

mx::array accumulate_prefix(const mx::array& acc, const mx::array& x, float alpha, float beta, int held,
                            mx::StreamOrDevice s) {
  check_accumulate(acc, x, held);
  auto stream = mx::to_stream(s);
  auto p = std::make_shared<AccumulatePrefix>(stream, alpha, beta, held);
  if (stream.device != mx::Device::cpu) return p->composed({acc, x})[0];
  return mx::array(acc.shape(), mx::float32, p, {acc, x});
}

std::vector<mx::array> accumulate_prefix_along(const mx::array& acc, const mx::array& x, float alpha, float beta, int held,
                                               const mx::array& along, mx::StreamOrDevice s) {
  check_accumulate(acc, x, held);
  auto stream = mx::to_stream(s);
  auto p = std::make_shared<AccumulatePrefix>(stream, alpha, beta, held);
  if (stream.device != mx::Device::cpu) return p->composed({acc, x, along});
  return mx::array::make_arrays({acc.shape(), along.shape()}, {mx::float32, along.dtype()}, p, {acc, x, along});
}

std::vector<mx::Shape> AccumulatePrefix::output_shapes(const std::vector<mx::array>& inputs) {
  if (inputs.size() == 3) return {inputs[0].shape(), inputs[2].shape()};
  return {inputs[0].shape()};
}

void AccumulatePrefix::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  // Asked before any copy of the handle below, which would count as another user of the buffer.
  const bool donatable = inputs[0].is_donatable();
  mx::array acc = inputs[0], x = inputs[1];
  auto& out = outputs[0];
  if (outputs.size() == 2) outputs[1].copy_shared_buffer(inputs[2]);  // `along`, passed through
  // The kernel reads and writes rows of C (acc, out) and N (x) contiguous elements.
  const bool copied = !acc.flags().row_contiguous;
  if (copied) acc = contiguous_copy(acc, enc);
  if (!x.flags().row_contiguous) x = contiguous_copy(x, enc);
  enc.set_input_array(acc);
  enc.set_input_array(x);
  // In place when no other array can observe acc's buffer (MLX's own condition for donation): the
  // usual case, since the cache replaces its column with the result.
  const bool in_place = copied || donatable;
  if (in_place) {
    out.copy_shared_buffer(acc);
  } else {
    out.set_data(mx::allocator::malloc(out.nbytes()));
  }
  enc.set_output_array(out);
  const int64_t C = acc.shape(-1), N = x.shape(-1);
  const int64_t rows = C == 0 ? 0 : static_cast<int64_t>(acc.size()) / C;
  enc.dispatch([a = acc.data<float>(), xs = x.data<float>(), o = out.data<float>(), rows, C, N, held = held_,
                alpha = alpha_, beta = beta_]() { accumulate_prefix_rows(a, xs, o, rows, C, N, held, alpha, beta); });
}

void AccumulatePrefix::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  // The op builds the composed graph for GPU streams, so this primitive never runs there.
  throw std::runtime_error("[accumulate_prefix] no GPU kernel; the op uses the composed path on GPU streams");
}

std::vector<mx::array> AccumulatePrefix::composed(const std::vector<mx::array>& inputs) {
  const auto& acc = inputs[0];
  const auto& x = inputs[1];
  const int nd = static_cast<int>(acc.ndim());
  const int N = x.shape(-1), held = std::min(held_, N);
  mx::Shape start(nd, 0), stop = acc.shape();
  stop.back() = N;
  auto prefix = mx::slice(acc, start, stop, stream());
  if (held < N) {  // entries appended since the column was written count as 0
    auto live = mx::less(mx::arange(N, mx::int32, stream()), mx::array(held), stream());
    prefix = mx::where(live, prefix, mx::array(0.0f), stream());
  }
  auto updated = mx::add(mx::multiply(mx::array(alpha_), prefix, stream()), mx::multiply(mx::array(beta_), x, stream()),
                         stream());
  auto column = mx::slice_update(acc, updated, start, stop, stream());
  if (inputs.size() == 3) return {column, inputs[2]};
  return {column};
}

bool AccumulatePrefix::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const AccumulatePrefix&>(other);
  return alpha_ == o.alpha_ && beta_ == o.beta_ && held_ == o.held_;
}

}  // namespace mlx_h2o
