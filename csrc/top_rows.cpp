#include "top_rows.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <stdexcept>

#include "mlx/backend/cpu/encoder.h"

#include "op_utils.h"

namespace mlx_h2o {

namespace {

mx::Shape selected_shape(const mx::array& key, int capacity) {
  mx::Shape shape = key.shape();
  shape.back() = capacity;
  return shape;
}

// The indices of a row's `count` best keys, ascending, into out[0, count). `ranked` and `order` are
// scratch of P values.
void select_row(const float* key, int P, int count, int32_t* out, std::vector<float>& ranked, std::vector<int32_t>& order) {
  if (count == P) {
    std::iota(out, out + P, 0);
    return;
  }
  for (int i = 0; i < P; ++i) ranked[i] = std::isnan(key[i]) ? -INFINITY : key[i];
  const float* k = ranked.data();
  // (key, lower index) first: a strict weak order even with ties and infinities
  auto before = [k](int32_t a, int32_t b) { return k[a] > k[b] || (k[a] == k[b] && a < b); };
  std::iota(order.begin(), order.end(), 0);
  std::nth_element(order.begin(), order.begin() + (count - 1), order.end(), before);
  const int32_t last = order[count - 1];  // the count-th best: every index ranked up to it is kept
  int n = 0;
  for (int32_t i = 0; i < P && n < count; ++i)
    if (!before(last, i)) out[n++] = i;
}

}  // namespace

mx::array top_rows(const mx::array& key, int count, int capacity, mx::StreamOrDevice s) {
  if (key.dtype() != mx::float32 || key.ndim() < 1)
    fail("key must be a float32 (..., P) array, got " + shape_str(key.shape()));
  const int P = key.shape(-1);
  if (count < 1 || count > P) fail("count must be in [1, " + std::to_string(P) + "] (the keys per row), got " + std::to_string(count));
  if (capacity == -1) capacity = count;
  if (capacity < count) fail("capacity must be at least count (" + std::to_string(count) + "), got " + std::to_string(capacity));
  auto stream = mx::to_stream(s);
  auto p = std::make_shared<TopRows>(stream, count, capacity);
  if (stream.device != mx::Device::cpu) return p->composed({key})[0];
  return mx::array(selected_shape(key, capacity), mx::int32, p, {key});
}

std::vector<mx::Shape> TopRows::output_shapes(const std::vector<mx::array>& inputs) {
  return {selected_shape(inputs[0], capacity_)};
}

bool TopRows::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const TopRows&>(other);
  return count_ == o.count_ && capacity_ == o.capacity_;
}

void TopRows::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  const auto in = prepare_contiguous(inputs, outputs, enc);
  const mx::array& key = in[0];
  const int P = key.shape(-1);
  const int64_t rows = key.size() / P;  // (P >= count >= 1)
  enc.dispatch([k = key.data<float>(), out = outputs[0].data<int32_t>(), rows, P, count = count_, capacity = capacity_]() {
    std::vector<float> ranked(P);
    std::vector<int32_t> order(P);
    for (int64_t r = 0; r < rows; ++r) {
      int32_t* o = out + r * capacity;
      select_row(k + r * P, P, count, o, ranked, order);
      std::memset(o + count, 0, (capacity - count) * sizeof(int32_t));
    }
  });
}

void TopRows::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  // The op builds the composed graph for GPU streams, so this primitive never runs there.
  throw std::runtime_error("[top_rows] no GPU kernel; the op uses the composed path on GPU streams");
}

std::vector<mx::array> TopRows::composed(const std::vector<mx::array>& inputs) {
  const auto& key = inputs[0];
  auto ranked = mx::where(mx::isnan(key, stream()), mx::array(-INFINITY), key, stream());
  auto order = mx::argsort(mx::negative(ranked, stream()), -1, stream());
  auto kept = mx::sort(mx::slice(order, mx::Shape(key.ndim(), 0), selected_shape(key, count_), stream()), -1, stream());
  kept = mx::astype(kept, mx::int32, stream());
  if (capacity_ == count_) return {kept};
  mx::Shape pad = selected_shape(key, capacity_ - count_);
  return {mx::concatenate({kept, mx::zeros(pad, mx::int32, stream())}, -1, stream())};
}

}  // namespace mlx_h2o
