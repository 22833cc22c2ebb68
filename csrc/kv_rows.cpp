#include "kv_rows.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/types/half_types.h"

#include "op_utils.h"

namespace mlx_h2o {

namespace {

/** f(T{}) for the C++ type T of a float32 / float16 / bfloat16 dtype (the ops check it is one). */
template <typename F>
void with_float_type(mx::Dtype t, F&& f) {
  if (t == mx::float32) {
    f(float{});
  } else if (t == mx::float16) {
    f(mx::float16_t{});
  } else {
    f(mx::bfloat16_t{});
  }
}

// The rotation's sums are most of what these ops cost at decode: 36 rows of 64 a layer and step (the
// query and output rotations, the new K and V rows of each of the six packed buffers' writes), at
// 4096 float64 multiply-adds a row in the dense loop, 384 additions in the Walsh-Hadamard transform
// (RotationPlan). Built for the baseline x86-64 that is 2 doubles per instruction; with GCC on
// x86-64 Linux both loops are also built for x86-64-v3 (AVX2 + FMA: 4 per instruction), the clone
// picked when the library loads. Either way every sum is float64, rounded once by the caller.
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__)
#define MLX_H2O_ROTATION_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define MLX_H2O_ROTATION_CLONES
#endif

/** acc[j] = sum_i x[i] * rotation[i][j] in float64, for one row x of D values. */
MLX_H2O_ROTATION_CLONES
void rotate_row_dense(const float* x, const float* rotation, int64_t D, double* acc) {
  std::fill(acc, acc + D, 0.0);
  for (int64_t i = 0; i < D; ++i) {
    const double xi = x[i];
    const float* ri = rotation + i * D;
    for (int64_t j = 0; j < D; ++j) acc[j] += xi * ri[j];
  }
}

/** acc = out_sign * (Walsh-Hadamard transform of in_scale * x), in place over D (a power of two)
 *  float64 values: H[i][j] = (-1)^popcount(i & j), Sylvester's order, as orthonormal_basis builds it. */
MLX_H2O_ROTATION_CLONES
void rotate_row_hadamard(const float* x, const double* in_scale, const float* out_sign, int64_t D, double* acc) {
  for (int64_t i = 0; i < D; ++i) acc[i] = in_scale[i] * x[i];
  for (int64_t h = 1; h < D; h *= 2) {
    for (int64_t i = 0; i < D; i += 2 * h) {
      for (int64_t j = i; j < i + h; ++j) {
        const double u = acc[j], v = acc[j + h];
        acc[j] = u + v;
        acc[j + h] = u - v;
      }
    }
  }
  for (int64_t j = 0; j < D; ++j) acc[j] *= out_sign[j];
}

// A float's bits read in place (float storage seen as uint32 without breaking aliasing rules).
typedef uint32_t __attribute__((may_alias)) float_bits;
constexpr uint32_t SIGN_BIT = 0x80000000u;

/** The signs of the D x D Walsh-Hadamard matrix (D a power of two, at most MAX_TRANSFORM_DIM) as
 *  float sign bits (0 for +1), row-major: built once per thread and D, kept for each D (keys and
 *  values may differ in head dim), so the check of a matrix takes no lock and rebuilds nothing. */
const uint32_t* hadamard_sign_bits(int64_t D) {
  thread_local std::array<std::vector<uint32_t>, 64> tables;  // by log2(D)
  auto& table = tables[__builtin_ctzll(static_cast<uint64_t>(D))];
  if (table.empty()) {
    table.resize(D * D);
    for (int64_t i = 0; i < D; ++i)
      for (int64_t j = 0; j < D; ++j) table[i * D + j] = __builtin_parityll(static_cast<uint64_t>(i & j)) ? SIGN_BIT : 0;
  }
  return table.data();
}

bool power_of_two(double a) {
  int exponent;
  return a > 0 && std::frexp(a, &exponent) == 0.5;
}

/** rotate_row_* of a row of T; `xf` is room for D floats. */
template <typename T>
void rotate_row(const T* x, const RotationPlan& rotation, int64_t D, float* xf, double* acc) {
  for (int64_t i = 0; i < D; ++i) xf[i] = static_cast<float>(x[i]);
  rotation.apply(xf, acc);
}

template <typename T, typename U>
void rotate_rows_typed(const T* x, int64_t x_row_stride, const RotationPlan& rotation, U* out, int64_t rows, int64_t D) {
  std::vector<double> acc(D);
  std::vector<float> xf(D);
  for (int64_t r = 0; r < rows; ++r) {
    rotate_row(x + r * x_row_stride, rotation, D, xf.data(), acc.data());
    for (int64_t j = 0; j < D; ++j) out[r * D + j] = static_cast<U>(static_cast<float>(acc[j]));
  }
}

struct RowsProblem {
  int64_t B, H, C, n, D;
  int64_t x_stride[3];       // x's strides (elements) over B, H, n; its rows are contiguous
  int64_t center_stride[2];  // the centre's over B, H (0 where broadcast); its rows are contiguous
  int start, bits, group_size;
};

/** Where a QuantizeRowsInto writes: each part's buffer (null: a part it does not write). */
struct PackedRowsOut {
  uint32_t* words;
  void* scales;
  void* biases;
};

/** One row of D values quantized as MLX's CPU Quantize kernel does it (affine: per group, the edge
 *  of larger magnitude is exactly representable), its words (D * bits / 32 uint32 a row), scales and
 *  biases (D / group_size T a row) written where `out` points (row `row` of each buffer). The same
 *  float32 operations in the same order, so the bits agree. */
template <typename T>
void quantize_row(const float* y, const PackedRowsOut& out, int64_t row, int D, int bits, int group_size) {
  const float n_bins = static_cast<float>((1 << bits) - 1);
  const float eps = 1e-7f;
  const int per_word = 32 / bits, words_per_group = group_size / per_word, groups = D / group_size;
  for (int g = 0; g < groups; ++g) {
    const float* w = y + g * group_size;
    float w_min = std::numeric_limits<float>::infinity(), w_max = -w_min;
    for (int j = 0; j < group_size; ++j) {
      w_max = std::max(w_max, w[j]);
      w_min = std::min(w_min, w[j]);
    }
    const bool mask = std::abs(w_min) > std::abs(w_max);
    float scale = std::max((w_max - w_min) / n_bins, eps);
    scale = mask ? scale : -scale;
    const float edge = mask ? w_min : w_max;
    const float q0 = std::rint(edge / scale);
    float bias = 0;
    if (q0 != 0) {
      scale = edge / q0;
      bias = edge;
    }
    if (out.scales) static_cast<T*>(out.scales)[row * groups + g] = static_cast<T>(scale);
    if (out.biases) static_cast<T*>(out.biases)[row * groups + g] = static_cast<T>(bias);
    if (!out.words) continue;
    uint32_t* words = out.words + row * (D * bits / 32) + g * words_per_group;
    for (int j = 0; j < words_per_group; ++j) {
      uint64_t word = 0;
      for (int k = 0; k < per_word; ++k) {
        float q = std::rint((w[j * per_word + k] - bias) / scale);
        q = std::min(std::max(q, 0.0f), n_bins);
        word |= static_cast<uint64_t>(q) << (k * bits);
      }
      words[j] = static_cast<uint32_t>(word);
    }
  }
}

/** Rows of x (X) made into the rows the buffers hold (of T, the scales' dtype): rounded to T, less
 *  the centre (rounded to T again), times the rotation (rounded to T), each step as the stock ops
 *  x.astype(T), (x - c).astype(T) and rotated(x, r, T) round it; then quantized into `out`. */
template <typename X, typename T>
void quantize_rows(const RowsProblem& p, const X* x, const float* center, const RotationPlan* rotation,
                   const PackedRowsOut& out) {
  const int64_t D = p.D;
  std::vector<float> y(D);
  std::vector<double> acc(D);
  for (int64_t plane = 0; plane < p.B * p.H; ++plane) {
    const int64_t b = plane / p.H, h = plane % p.H;
    const float* c = center ? center + b * p.center_stride[0] + h * p.center_stride[1] : nullptr;
    for (int64_t r = 0; r < p.n; ++r) {
      const X* xr = x + b * p.x_stride[0] + h * p.x_stride[1] + r * p.x_stride[2];
      for (int64_t j = 0; j < D; ++j) y[j] = static_cast<float>(static_cast<T>(static_cast<float>(xr[j])));
      if (c) {
        for (int64_t j = 0; j < D; ++j) y[j] = static_cast<float>(static_cast<T>(y[j] - c[j]));
      }
      if (rotation) {
        rotation->apply(y.data(), acc.data());
        for (int64_t j = 0; j < D; ++j) y[j] = static_cast<float>(static_cast<T>(static_cast<float>(acc[j])));
      }
      quantize_row<T>(y.data(), out, plane * p.C + p.start + r, static_cast<int>(D), p.bits, p.group_size);
    }
  }
}

}  // namespace

RotationPlan::RotationPlan(const float* rotation, int64_t D) : rotation_(rotation), D_(D) {
  // rotation[i][j] = in_scale[i] * H[i][j] * out_sign[j] with out_sign[0] = 1 (H's first row and
  // column are all +1): in_scale is the first column, out_sign the first row over its first entry.
  // Checked at every call (a few hundred a decode step), bit for bit, with no allocation or lock:
  // row i must be row 0 with the signs of H's row i, flipped once more where rotation[i][0]'s sign
  // differs from rotation[0][0]'s.
  if (D < 2 || D > MAX_TRANSFORM_DIM || (D & (D - 1)) || !power_of_two(std::abs(rotation[0]))) return;
  const float a = std::abs(rotation[0]);
  for (int64_t j = 0; j < D; ++j)
    if (std::abs(rotation[j]) != a) return;
  const auto* bits = reinterpret_cast<const float_bits*>(rotation);
  const uint32_t* h = hadamard_sign_bits(D);
  uint32_t differ = 0;  // (accumulated, not an early exit: the loop vectorizes)
  for (int64_t i = 0; i < D; ++i) {
    const uint32_t flip = (bits[i * D] ^ bits[0]) & SIGN_BIT;
    for (int64_t j = 0; j < D; ++j) differ |= bits[i * D + j] ^ bits[j] ^ h[i * D + j] ^ flip;
  }
  if (differ) return;
  for (int64_t i = 0; i < D; ++i) {
    in_scale_[i] = rotation[i * D];
    out_sign_[i] = rotation[i] / rotation[0];
  }
  fast_ = true;
}

void RotationPlan::apply(const float* x, double* acc) const {
  if (!fast_) {
    rotate_row_dense(x, rotation_, D_, acc);
  } else {
    rotate_row_hadamard(x, in_scale_.data(), out_sign_.data(), D_, acc);
  }
}

mx::array rotated(const mx::array& x, const mx::array& rotation, mx::Dtype dtype, mx::StreamOrDevice s) {
  return mx::astype(mx::matmul(mx::astype(x, mx::float32, s), rotation, s), dtype, s);
}

void check_rotation(const mx::array& rotation, int D, const std::string& what, const mx::array& x) {
  if (rotation.dtype() != mx::float32 || rotation.shape() != mx::Shape{D, D})
    fail(what + " must be a float32 (" + std::to_string(D) + ", " + std::to_string(D) + ") array for rows " +
         shape_str(x.shape()) + ", got shape " + shape_str(rotation.shape()));
}

void rotate_rows_cpu(const void* x, mx::Dtype x_type, int64_t x_row_stride, const RotationPlan& rotation, void* out,
                     mx::Dtype out_type, int64_t rows, int64_t D) {
  with_float_type(x_type, [&](auto xe) {
    with_float_type(out_type, [&](auto oe) {
      rotate_rows_typed(static_cast<const decltype(xe)*>(x), x_row_stride, rotation, static_cast<decltype(oe)*>(out),
                        rows, D);
    });
  });
}

mx::array rotate_rows(const mx::array& x, const mx::array& rotation, mx::Dtype dtype, mx::StreamOrDevice s) {
  if (x.ndim() < 1 || !is_float_dtype(x.dtype())) fail("x must be a float32, float16 or bfloat16 array (..., D)");
  if (!is_float_dtype(dtype)) fail("dtype must be float32, float16 or bfloat16");
  check_rotation(rotation, x.shape(-1), "rotation", x);
  auto stream = mx::to_stream(s);
  auto p = std::make_shared<RotateRows>(stream, dtype);
  if (stream.device != mx::Device::cpu) return p->composed({x, rotation})[0];
  return mx::array(x.shape(), dtype, p, {x, rotation});
}

void RotateRows::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  const auto in = prepare_contiguous(inputs, outputs, enc);
  auto& out = outputs[0];
  const int64_t D = in[0].shape(-1), rows = D == 0 ? 0 : static_cast<int64_t>(in[0].size()) / D;
  enc.dispatch([x = in[0].data<void>(), xt = in[0].dtype(), r = in[1].data<float>(), o = out.data<void>(),
                ot = out.dtype(), rows, D]() { rotate_rows_cpu(x, xt, D, RotationPlan(r, D), o, ot, rows, D); });
}

void RotateRows::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  // The op builds the composed graph for GPU streams, so this primitive never runs there.
  throw std::runtime_error("[rotate_rows] no GPU kernel; the op uses the composed path on GPU streams");
}

std::vector<mx::array> RotateRows::composed(const std::vector<mx::array>& inputs) {
  return {rotated(inputs[0], inputs[1], dtype_, stream())};
}

bool RotateRows::is_equivalent(const mx::Primitive& other) const {
  return dtype_ == static_cast<const RotateRows&>(other).dtype_;
}

std::vector<mx::array> quantize_rows_into(const mx::array& packed, const mx::array& scales, const mx::array& biases,
                                          const mx::array& x, int start, const std::optional<mx::array>& rotation,
                                          int bits, int group_size, const std::optional<mx::array>& center,
                                          mx::StreamOrDevice s) {
  if (bits != 2 && bits != 4 && bits != 8) fail("bits must be 2, 4 or 8, got " + std::to_string(bits));
  if (group_size != 32 && group_size != 64 && group_size != 128)
    fail("group_size must be 32, 64 or 128, got " + std::to_string(group_size));
  if (x.ndim() != 4 || !is_float_dtype(x.dtype()))
    fail("x must be a float32, float16 or bfloat16 array (B, H, n, D), got shape " + shape_str(x.shape()));
  const int B = x.shape(0), H = x.shape(1), n = x.shape(2), D = x.shape(3);
  if (D % group_size) fail("group_size " + std::to_string(group_size) + " does not divide the head dimension " +
                           std::to_string(D));
  if (packed.ndim() != 4 || packed.dtype() != mx::uint32)
    fail("packed must be a uint32 array (B, H, C, D * bits / 32), got shape " + shape_str(packed.shape()));
  const int C = packed.shape(2);
  const mx::Shape words{B, H, C, D * bits / 32}, groups{B, H, C, D / group_size};
  if (packed.shape() != words)
    fail("packed must have shape " + shape_str(words) + " for x " + shape_str(x.shape()) + " at " +
         std::to_string(bits) + " bits, got " + shape_str(packed.shape()));
  if (!is_float_dtype(scales.dtype()) || scales.dtype() != biases.dtype() || scales.shape() != groups ||
      biases.shape() != groups)
    fail("scales and biases must be float arrays of one dtype and shape " + shape_str(groups) + ", got " +
         shape_str(scales.shape()) + " and " + shape_str(biases.shape()));
  if (start < 0 || start + n > C)
    fail("rows [" + std::to_string(start) + ", " + std::to_string(start + n) + ") are outside the buffers' " +
         std::to_string(C) + " rows");
  if (rotation) check_rotation(*rotation, D, "rotation", x);
  if (center && (center->dtype() != mx::float32 || center->ndim() != 4 || center->shape(2) != 1 ||
                 center->shape(3) != D || (center->shape(0) != B && center->shape(0) != 1) ||
                 (center->shape(1) != H && center->shape(1) != 1)))
    fail("center must be a float32 (B, H, 1, D) array for x " + shape_str(x.shape()) + " (B and H may be 1), got " +
         shape_str(center->shape()));
  auto stream = mx::to_stream(s);
  const std::vector<mx::array> buffers{packed, scales, biases};
  std::vector<mx::array> extra{x};
  if (rotation) extra.push_back(*rotation);
  if (center) extra.push_back(*center);
  // The parts each primitive writes: all three at once where a copy of the buffers is cheap, else one
  // primitive per buffer, so that each can be written in place.
  std::vector<std::vector<PackedPart>> writes;
  if (packed.nbytes() + scales.nbytes() + biases.nbytes() <= QuantizeRowsInto::ONE_PRIMITIVE_MAX_BYTES) {
    writes.push_back({PackedPart::words, PackedPart::scales, PackedPart::biases});
  } else {
    writes = {{PackedPart::words}, {PackedPart::scales}, {PackedPart::biases}};
  }
  std::vector<mx::array> out;
  for (const auto& parts : writes) {
    auto p = std::make_shared<QuantizeRowsInto>(stream, parts, scales.dtype(), start, bits, group_size,
                                                rotation.has_value(), center.has_value());
    std::vector<mx::array> inputs;
    for (auto part : parts) inputs.push_back(buffers[static_cast<int>(part)]);
    inputs.insert(inputs.end(), extra.begin(), extra.end());
    std::vector<mx::array> written;
    if (stream.device != mx::Device::cpu) {
      written = p->composed(inputs);
    } else {
      std::vector<mx::Shape> shapes;
      std::vector<mx::Dtype> dtypes;
      for (auto part : parts) {
        shapes.push_back(buffers[static_cast<int>(part)].shape());
        dtypes.push_back(buffers[static_cast<int>(part)].dtype());
      }
      written = mx::array::make_arrays(std::move(shapes), dtypes, p, std::move(inputs));
    }
    out.insert(out.end(), written.begin(), written.end());
  }
  return out;
}

void QuantizeRowsInto::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  const int n_parts = static_cast<int>(parts_.size());
  // Asked before any copy of the handle below, which would count as another user of the buffer. (MLX
  // gives every output of a primitive its own reference to the inputs: with several, none is donatable.)
  const bool donatable = n_parts == 1 && inputs[0].is_donatable();
  std::vector<mx::array> in = inputs;
  std::vector<bool> copied(n_parts);
  for (int i = 0; i < n_parts; ++i) {
    copied[i] = !in[i].flags().row_contiguous;
    if (copied[i]) in[i] = contiguous_copy(in[i], enc);
  }
  // x is read by its strides (the model's values arrive as a transposed view), its rows as vectors
  const int xi = x_input(), ri = rotation_input(), ci = center_input();
  if (needs_copy(in[xi])) in[xi] = contiguous_copy(in[xi], enc);
  if (rotated_ && !in[ri].flags().row_contiguous) in[ri] = contiguous_copy(in[ri], enc);
  if (centered_ && needs_copy(in[ci])) in[ci] = contiguous_copy(in[ci], enc);
  for (auto& a : in) enc.set_input_array(a);
  // In place when no other array can observe the buffer (MLX's own condition for donation): the
  // usual case for a single part, since the cache replaces its buffer with the result. Otherwise a
  // copy, then the rows.
  struct Copy {
    const void* src;
    void* dst;
    size_t bytes;
  };
  std::vector<Copy> copies;
  PackedRowsOut dst{nullptr, nullptr, nullptr};
  for (int i = 0; i < n_parts; ++i) {
    auto& out = outputs[i];
    if (copied[i] || donatable) {
      out.copy_shared_buffer(in[i]);
    } else {
      out.set_data(mx::allocator::malloc(out.nbytes()));
      copies.push_back({in[i].data<void>(), out.data<void>(), out.nbytes()});
    }
    enc.set_output_array(out);
    switch (parts_[i]) {
      case PackedPart::words: dst.words = out.data<uint32_t>(); break;
      case PackedPart::scales: dst.scales = out.data<void>(); break;
      case PackedPart::biases: dst.biases = out.data<void>(); break;
    }
  }
  const auto& x = in[xi];
  const int64_t center_b = centered_ && in[ci].shape(0) > 1 ? in[ci].strides(0) : 0;
  const int64_t center_h = centered_ && in[ci].shape(1) > 1 ? in[ci].strides(1) : 0;
  RowsProblem p{x.shape(0), x.shape(1), in[0].shape(2), x.shape(2), x.shape(3),
                {x.strides(0), x.strides(1), x.strides(2)}, {center_b, center_h}, start_, bits_, group_size_};
  enc.dispatch([p, copies = std::move(copies), dst, x_type = x.dtype(), row_type = row_dtype_, xs = x.data<void>(),
                rotation = rotated_ ? in[ri].data<float>() : nullptr,
                center = centered_ ? in[ci].data<float>() : nullptr]() {
    for (const auto& c : copies) std::memcpy(c.dst, c.src, c.bytes);
    const std::optional<RotationPlan> plan =
        rotation ? std::optional<RotationPlan>(std::in_place, rotation, p.D) : std::nullopt;
    with_float_type(x_type, [&](auto xe) {
      with_float_type(row_type, [&](auto te) {
        quantize_rows<decltype(xe), decltype(te)>(p, static_cast<const decltype(xe)*>(xs), center,
                                                  plan ? &*plan : nullptr, dst);
      });
    });
  });
}

void QuantizeRowsInto::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  // The op builds the composed graph for GPU streams, so this primitive never runs there.
  throw std::runtime_error("[quantize_rows_into] no GPU kernel; the op uses the composed path on GPU streams");
}

std::vector<mx::array> QuantizeRowsInto::composed(const std::vector<mx::array>& inputs) {
  const auto& x = inputs[x_input()];
  const auto dtype = row_dtype_;
  auto y = mx::astype(x, dtype, stream());
  if (centered_) y = mx::astype(mx::subtract(y, inputs[center_input()], stream()), dtype, stream());
  if (rotated_) y = rotated(y, inputs[rotation_input()], dtype, stream());
  auto rows = mx::quantize(y, group_size_, bits_, "affine", std::nullopt, stream());
  std::vector<mx::array> out;
  for (int i = 0; i < x_input(); ++i) {
    mx::Shape start(4, 0), stop = inputs[i].shape();
    start[2] = start_;
    stop[2] = start_ + x.shape(2);
    out.push_back(mx::slice_update(inputs[i], rows[static_cast<int>(parts_[i])], start, stop, stream()));
  }
  return out;
}

std::vector<mx::Shape> QuantizeRowsInto::output_shapes(const std::vector<mx::array>& inputs) {
  std::vector<mx::Shape> shapes;
  for (size_t i = 0; i < parts_.size(); ++i) shapes.push_back(inputs[i].shape());
  return shapes;
}

bool QuantizeRowsInto::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const QuantizeRowsInto&>(other);
  return parts_ == o.parts_ && start_ == o.start_ && bits_ == o.bits_ && group_size_ == o.group_size_ &&
         rotated_ == o.rotated_ && centered_ == o.centered_ && row_dtype_ == o.row_dtype_;
}

}  // namespace mlx_h2o
