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
  int64_t x_stride[3];  // x's strides (elements) over B, H, n; its rows are contiguous
  int start, bits, group_size;
  PackedPart part;
};

/** One row of D values quantized as MLX's CPU Quantize kernel does it (affine: per group, the edge
 *  of larger magnitude is exactly representable): `part` of it, words (D * bits / 32 uint32) or
 *  scales or biases (D / group_size T), into `out`. The same float32 operations in the same order,
 *  so the bits agree. */
template <typename T>
void quantize_row(const float* y, PackedPart part, void* out, int D, int bits, int group_size) {
  const float n_bins = static_cast<float>((1 << bits) - 1);
  const float eps = 1e-7f;
  const int per_word = 32 / bits, words_per_group = group_size / per_word;
  for (int g = 0; g < D / group_size; ++g) {
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
    if (part == PackedPart::scales) {
      static_cast<T*>(out)[g] = static_cast<T>(scale);
      continue;
    }
    if (part == PackedPart::biases) {
      static_cast<T*>(out)[g] = static_cast<T>(bias);
      continue;
    }
    auto* words = static_cast<uint32_t*>(out);
    for (int j = 0; j < words_per_group; ++j) {
      uint64_t word = 0;
      for (int k = 0; k < per_word; ++k) {
        float q = std::rint((w[j * per_word + k] - bias) / scale);
        q = std::min(std::max(q, 0.0f), n_bins);
        word |= static_cast<uint64_t>(q) << (k * bits);
      }
      words[g * words_per_group + j] = static_cast<uint32_t>(word);
    }
  }
}

template <typename T>
void quantize_rows(const RowsProblem& p, const T* x, const RotationPlan* rotation, void* out) {
  const int64_t D = p.D;
  // the part's row: words (uint32) or groups (T)
  const int64_t row_bytes = p.part == PackedPart::words ? D * p.bits / 32 * 4 : D / p.group_size * sizeof(T);
  std::vector<float> y(D);
  std::vector<double> acc(D);
  for (int64_t plane = 0; plane < p.B * p.H; ++plane) {
    for (int64_t r = 0; r < p.n; ++r) {
      const T* xr = x + (plane / p.H) * p.x_stride[0] + (plane % p.H) * p.x_stride[1] + r * p.x_stride[2];
      if (rotation) {
        rotate_row(xr, *rotation, D, y.data(), acc.data());
        // the rotated row in x's dtype, as the cache stores it before packing
        for (int64_t j = 0; j < D; ++j) y[j] = static_cast<float>(static_cast<T>(static_cast<float>(acc[j])));
      } else {
        for (int64_t j = 0; j < D; ++j) y[j] = static_cast<float>(xr[j]);
      }
      const int64_t row = plane * p.C + p.start + r;
      quantize_row<T>(y.data(), p.part, static_cast<char*>(out) + row * row_bytes, static_cast<int>(D), p.bits,
                      p.group_size);
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
                                          int bits, int group_size, mx::StreamOrDevice s) {
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
  for (const auto* a : {&scales, &biases}) {
    if (a->shape() != groups || a->dtype() != x.dtype())
      fail("scales and biases must have shape " + shape_str(groups) + " and x's dtype, got " +
           shape_str(a->shape()));
  }
  if (start < 0 || start + n > C)
    fail("rows [" + std::to_string(start) + ", " + std::to_string(start + n) + ") are outside the buffers' " +
         std::to_string(C) + " rows");
  if (rotation) check_rotation(*rotation, D, "rotation", x);
  auto stream = mx::to_stream(s);
  std::vector<mx::array> out;
  const mx::array* buffers[3] = {&packed, &scales, &biases};
  for (int i = 0; i < 3; ++i) {
    auto p = std::make_shared<QuantizeRowsInto>(stream, static_cast<PackedPart>(i), start, bits, group_size,
                                                rotation.has_value());
    std::vector<mx::array> inputs{*buffers[i], x};
    if (rotation) inputs.push_back(*rotation);
    if (stream.device != mx::Device::cpu) {
      out.push_back(p->composed(inputs)[0]);
    } else {
      out.emplace_back(buffers[i]->shape(), buffers[i]->dtype(), p, std::move(inputs));
    }
  }
  return out;
}

void QuantizeRowsInto::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  // Asked before any copy of the handle below, which would count as another user of the buffer.
  const bool donatable = inputs[0].is_donatable();
  std::vector<mx::array> in = inputs;
  const bool copied = !in[0].flags().row_contiguous;
  if (copied) in[0] = contiguous_copy(in[0], enc);
  // x is read by its strides (the model's values arrive as a transposed view), its rows as vectors
  if (needs_copy(in[1])) in[1] = contiguous_copy(in[1], enc);
  if (rotated_ && !in[2].flags().row_contiguous) in[2] = contiguous_copy(in[2], enc);
  for (auto& a : in) enc.set_input_array(a);
  auto& out = outputs[0];
  // In place when no other array can observe the buffer (MLX's own condition for donation): the
  // usual case, since the cache replaces its buffer with the result. Otherwise a copy, then the rows.
  const bool fresh = !(copied || donatable);
  if (fresh) {
    out.set_data(mx::allocator::malloc(out.nbytes()));
  } else {
    out.copy_shared_buffer(in[0]);
  }
  enc.set_output_array(out);
  const auto& x = in[1];
  RowsProblem p{x.shape(0), x.shape(1), in[0].shape(2), x.shape(2), x.shape(3),
                {x.strides(0), x.strides(1), x.strides(2)}, start_, bits_, group_size_, part_};
  enc.dispatch([p, fresh, dtype = x.dtype(), xs = x.data<void>(), rotation = rotated_ ? in[2].data<float>() : nullptr,
                src = in[0].data<void>(), dst = out.data<void>(), bytes = out.nbytes()]() {
    if (fresh) std::memcpy(dst, src, bytes);
    const std::optional<RotationPlan> plan =
        rotation ? std::optional<RotationPlan>(std::in_place, rotation, p.D) : std::nullopt;
    with_float_type(dtype, [&](auto e) {
      quantize_rows(p, static_cast<const decltype(e)*>(xs), plan ? &*plan : nullptr, dst);
    });
  });
}

void QuantizeRowsInto::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  // The op builds the composed graph for GPU streams, so this primitive never runs there.
  throw std::runtime_error("[quantize_rows_into] no GPU kernel; the op uses the composed path on GPU streams");
}

std::vector<mx::array> QuantizeRowsInto::composed(const std::vector<mx::array>& inputs) {
  const auto& x = inputs[1];
  const auto y = rotated_ ? rotated(x, inputs[2], x.dtype(), stream()) : x;
  auto rows = mx::quantize(y, group_size_, bits_, "affine", std::nullopt, stream());
  mx::Shape start(4, 0), stop = inputs[0].shape();
  start[2] = start_;
  stop[2] = start_ + x.shape(2);
  return {mx::slice_update(inputs[0], rows[static_cast<int>(part_)], start, stop, stream())};
}

bool QuantizeRowsInto::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const QuantizeRowsInto&>(other);
  return part_ == o.part_ && start_ == o.start_ && bits_ == o.bits_ && group_size_ == o.group_size_ &&
         rotated_ == o.rotated_;
}

}  // namespace mlx_h2o
