// The K/V rows a cache stores, one primitive per step of their way in and out:
// - rotate_rows: rows times a rotation (a rotated cache's queries on the way in, its attention
//   output on the way back, storage/rotation.py), where a matmul of a few rows was three primitives
//   (flatten, matmul, unflatten);
// - quantize_rows_into: new K or V rows written into a cache's packed buffers.
//
// A cache that stores rows packed (MLX's affine format: packed words, scales, biases) appends each
// decode step's rows as mx.quantize and three slice_updates, plus a matmul (flatten, matmul,
// unflatten) when it keeps them rotated (storage/rotation.py), and a cast, a subtraction and a cast
// back when it keeps its keys less their mean (CenteredKeysKV): up to ten primitives for K and seven
// for V per layer and step, each scheduled on its own, for a few rows. Here one primitive rounds,
// centres, rotates, quantizes and writes the rows: into all three buffers where they are small
// enough to copy, else one primitive per buffer, in place when MLX can donate it (see
// QuantizeRowsInto::ONE_PRIMITIVE_MAX_BYTES).
#pragma once

#include <array>
#include <optional>
#include <string>
#include <vector>

#include "mlx/ops.h"

#include "composed_primitive.h"

namespace mlx_h2o {

namespace mx = mlx::core;

/** x (..., D) float32 / float16 / bfloat16 rows times a float32 (D, D) `rotation`: x @ rotation,
 *  each output summed in float64 and rounded once to `dtype` (float32, float16 or bfloat16). */
mx::array rotate_rows(const mx::array& x, const mx::array& rotation, mx::Dtype dtype, mx::StreamOrDevice s = {});

/** How rows are multiplied by a float32 (D, D) row-major `rotation` on the CPU, decided once per
 *  call from the matrix's values. A rotated cache's matrices for a power-of-two head dim are a
 *  Walsh-Hadamard matrix with signs on its rows and columns, times 1/sqrt(D) (storage/rotation.py);
 *  where that factor is a power of two (D = 4, 16, 64, 256, ...) every product x_i * r_ij is an
 *  exact float64, and a fast Walsh-Hadamard transform adds the same products in D log2 D additions
 *  instead of the dense loop's D^2 multiply-adds (384 against 4096 at D = 64). Only the order of
 *  the float64 additions differs: nothing changes where those sums are exact (values spanning
 *  less than ~2^23 at D = 64), and elsewhere at most the float64 sum's last bit moves before it is
 *  rounded to float32. Any other matrix takes the dense loop. */
class RotationPlan {
 public:
  RotationPlan(const float* rotation, int64_t D);
  /** acc[j] = sum_i x[i] * rotation[i][j] in float64, for one row x of D values. */
  void apply(const float* x, double* acc) const;

  /** The largest head dim the transform takes (its signs live in the plan, on the stack). */
  static constexpr int64_t MAX_TRANSFORM_DIM = 256;

 private:
  const float* rotation_;
  int64_t D_;
  bool fast_ = false;
  // The transform's form, its first D entries set when fast_ (left uninitialized otherwise: the
  // dense path, for most calls of other matrices, should not clear 3 KB it never reads):
  // rotation[i][j] = in_scale[i] * H[i][j] * out_sign[j].
  std::array<double, MAX_TRANSFORM_DIM> in_scale_;
  std::array<float, MAX_TRANSFORM_DIM> out_sign_;
};

/** The CPU loop behind rotate_rows: `rows` rows of D values, row r at x + r * x_row_stride elements
 *  (x_type float32 / float16 / bfloat16), times the plan's rotation into out (rows, D) contiguous,
 *  in out_type; each output summed in float64 and rounded once. The fused attention op rotates its
 *  queries and output with it (attention_with_scores.cpp). */
void rotate_rows_cpu(const void* x, mx::Dtype x_type, int64_t x_row_stride, const RotationPlan& rotation, void* out,
                     mx::Dtype out_type, int64_t rows, int64_t D);

/** The stock-ops definition of rotate_rows: x @ rotation in float32, then `dtype` (what the composed
 *  paths run, off the CPU and for vjp / jvp / vmap). */
mx::array rotated(const mx::array& x, const mx::array& rotation, mx::Dtype dtype, mx::StreamOrDevice s = {});

/** A ValueError unless `rotation` is a float32 (D, D) array for the rows of x (`what` names it). */
void check_rotation(const mx::array& rotation, int D, const std::string& what, const mx::array& x);

class RotateRows : public ComposedPrimitive {
 public:
  RotateRows(mx::Stream stream, mx::Dtype dtype) : ComposedPrimitive(stream), dtype_(dtype) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::array> composed(const std::vector<mx::array>& inputs) override;
  const char* name() const override { return "RotateRows"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }

 private:
  mx::Dtype dtype_;
};

/** The buffers (packed (B, H, C, D * bits / 32) uint32, scales and biases (B, H, C, D / group_size)
 *  of one float dtype T) with rows [start, start + n) replaced by mx::quantize(y, group_size, bits)
 *  of the rows y made from x (B, H, n, D, any float dtype) as the stock ops would make them:
 *  y = x.astype(T); less a float32 (B, H, 1, D) `center` (B and H may be 1), (y - center).astype(T);
 *  times a float32 (D, D) `rotation`, rotate_rows(y, rotation, T). Rows outside [start, start + n) are
 *  unchanged. bits: 2, 4 or 8; group_size: 32, 64 or 128, dividing D. */
std::vector<mx::array> quantize_rows_into(const mx::array& packed, const mx::array& scales, const mx::array& biases,
                                          const mx::array& x, int start, const std::optional<mx::array>& rotation,
                                          int bits, int group_size, const std::optional<mx::array>& center = std::nullopt,
                                          mx::StreamOrDevice s = {});

/** An array of the packed format. */
enum class PackedPart : int { words = 0, scales = 1, biases = 2 };

/** Inputs: {the buffers of its parts, x, rotation (when rotated), center (when centred)}; an output
 *  per part, the buffer written. */
class QuantizeRowsInto : public ComposedPrimitive {
 public:
  /** Buffers up to this many bytes (the three together) are written by one primitive with three
   *  outputs, which copies them: MLX gives every output of a primitive its own reference to the
   *  inputs, so an input of a multi-output primitive is never donatable. Copying a buffer of a few
   *  dozen KB costs ~2-4 us, scheduling two more primitives more (an h2o cache's newest rows, 8-bit:
   *  ~30 KB a layer for K, and for V). Larger buffers get a primitive each, written in place. */
  static constexpr size_t ONE_PRIMITIVE_MAX_BYTES = 64 * 1024;

  QuantizeRowsInto(mx::Stream stream, std::vector<PackedPart> parts, mx::Dtype row_dtype, int start, int bits,
                   int group_size, bool rotated, bool centered)
      : ComposedPrimitive(stream),
        parts_(std::move(parts)),
        row_dtype_(row_dtype),
        start_(start),
        bits_(bits),
        group_size_(group_size),
        rotated_(rotated),
        centered_(centered) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::array> composed(const std::vector<mx::array>& inputs) override;
  const char* name() const override { return "QuantizeRowsInto"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  // The inputs' order: the parts' buffers, x, the rotation (when rotated), the centre (when centred).
  int x_input() const { return static_cast<int>(parts_.size()); }
  int rotation_input() const { return x_input() + 1; }
  int center_input() const { return x_input() + (rotated_ ? 2 : 1); }

  std::vector<PackedPart> parts_;
  mx::Dtype row_dtype_;  // the scales' and biases' (the rows are rounded to it before packing)
  int start_, bits_, group_size_;
  bool rotated_, centered_;
};

}  // namespace mlx_h2o
