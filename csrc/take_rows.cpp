#include "take_rows.h"

#include <cstring>
#include <stdexcept>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

#include "op_utils.h"

namespace mlx_h2o {

namespace {

mx::Shape taken_shape(const mx::array& a, int K) {
  mx::Shape shape = a.shape();
  shape[2] = K;
  return shape;
}

}  // namespace

std::vector<mx::array> take_rows(const std::vector<mx::array>& arrays, const mx::array& idx, mx::StreamOrDevice s) {
  if (arrays.empty()) fail("take_rows needs at least one array");
  if ((idx.dtype() != mx::int32 && idx.dtype() != mx::uint32) || idx.ndim() != 3)
    fail("idx must be an int32 or uint32 (B, H, K) array, got " + shape_str(idx.shape()));
  std::vector<mx::Shape> shapes;
  std::vector<mx::Dtype> dtypes;
  for (const auto& a : arrays) {
    if (a.ndim() < 3 || a.shape(0) != idx.shape(0) || a.shape(1) != idx.shape(1))
      fail("each array must be (B, H, C, ...) with idx's (B, H) = " + shape_str({idx.shape(0), idx.shape(1)}) + ", got " +
           shape_str(a.shape()));
    shapes.push_back(taken_shape(a, idx.shape(2)));
    dtypes.push_back(a.dtype());
  }
  auto stream = mx::to_stream(s);
  auto p = std::make_shared<TakeRows>(stream);
  std::vector<mx::array> inputs = arrays;
  inputs.push_back(idx);
  if (stream.device != mx::Device::cpu) return p->composed(inputs);
  return mx::array::make_arrays(std::move(shapes), std::move(dtypes), p, std::move(inputs));
}

std::vector<mx::Shape> TakeRows::output_shapes(const std::vector<mx::array>& inputs) {
  const int K = inputs.back().shape(2);
  std::vector<mx::Shape> shapes;
  for (size_t i = 0; i + 1 < inputs.size(); ++i) shapes.push_back(taken_shape(inputs[i], K));
  return shapes;
}

void TakeRows::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  // Rows are copied as blocks of bytes: every input is read row-contiguous (a copy when it is not).
  const auto in = prepare_contiguous(inputs, outputs, enc);
  const mx::array& idx = in.back();
  const int64_t BH = static_cast<int64_t>(idx.shape(0)) * idx.shape(1), K = idx.shape(2);
  struct Buffer {
    const char* src;
    char* dst;
    int64_t C, row_bytes;
  };
  std::vector<Buffer> buffers;
  for (size_t i = 0; i + 1 < in.size(); ++i) {
    const auto& a = in[i];
    int64_t row_bytes = a.itemsize();  // the trailing axes' (an empty buffer's rows have a size too)
    for (int d = 3; d < static_cast<int>(a.ndim()); ++d) row_bytes *= a.shape(d);
    buffers.push_back({a.data<char>(), outputs[i].data<char>(), a.shape(2), row_bytes});
  }
  // (uint32 indices, as argpartition gives them, read as int64: never negative)
  enc.dispatch([buffers = std::move(buffers), ix = idx.data<char>(), is_signed = idx.dtype() == mx::int32, BH, K]() {
    auto index = [&](int64_t i) -> int64_t {
      return is_signed ? reinterpret_cast<const int32_t*>(ix)[i] : reinterpret_cast<const uint32_t*>(ix)[i];
    };
    for (const Buffer& b : buffers) {
      for (int64_t bh = 0; bh < BH; ++bh) {
        const char* src = b.src + bh * b.C * b.row_bytes;
        char* dst = b.dst + bh * K * b.row_bytes;
        for (int64_t k = 0; k < K; ++k, dst += b.row_bytes) {
          const int64_t r = index(bh * K + k);
          if (r >= 0 && r < b.C) {
            std::memcpy(dst, src + r * b.row_bytes, b.row_bytes);
          } else {
            std::memset(dst, 0, b.row_bytes);  // (documented: an index outside [0, C) reads nothing)
          }
        }
      }
    }
  });
}

void TakeRows::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  // The op builds the composed graph for GPU streams, so this primitive never runs there.
  throw std::runtime_error("[take_rows] no GPU kernel; the op uses the composed path on GPU streams");
}

std::vector<mx::array> TakeRows::composed(const std::vector<mx::array>& inputs) {
  const auto& idx = inputs.back();
  const auto signed_idx = mx::astype(idx, mx::int64, stream());
  std::vector<mx::array> out;
  for (size_t i = 0; i + 1 < inputs.size(); ++i) {
    const auto& a = inputs[i];
    const int C = a.shape(2);
    auto valid = mx::logical_and(mx::greater_equal(signed_idx, mx::array(0), stream()),
                                 mx::less(signed_idx, mx::array(C), stream()), stream());
    auto safe = mx::where(valid, signed_idx, mx::array(0, mx::int64), stream());
    // idx (B, H, K) as (B, H, K, 1, ...) broadcast to the rows' trailing shape
    mx::Shape expanded = idx.shape();
    for (int d = 3; d < static_cast<int>(a.ndim()); ++d) expanded.push_back(1);
    mx::Shape target = taken_shape(a, idx.shape(2));
    auto rows = mx::take_along_axis(a, mx::broadcast_to(mx::reshape(safe, expanded, stream()), target, stream()), 2, stream());
    auto keep = mx::broadcast_to(mx::reshape(valid, expanded, stream()), target, stream());
    out.push_back(mx::where(keep, rows, mx::zeros_like(rows, stream()), stream()));
  }
  return out;
}

}  // namespace mlx_h2o
