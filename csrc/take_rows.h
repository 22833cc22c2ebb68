// take_rows: the rows a compaction keeps, gathered from every buffer of a cache layer in one pass.
//
// An h2o compaction keeps chosen rows per (batch, head) of each of its buffers: K and V (dense, or a
// packed format's words, scales and biases) and the per-entry columns (score, position). As stock
// ops each buffer was a `take` over its flattened rows, with the flat index built from the chosen
// indices (an arange, a multiply, an add, reshapes): ~7 primitives for the index and ~3 per
// buffer, and MLX's gather copies element by element. Here one primitive copies whole rows of
// every buffer that shares the index.
#pragma once

#include <vector>

#include "mlx/ops.h"

#include "composed_primitive.h"

namespace mlx_h2o {

namespace mx = mlx::core;

/** For each array a (B, H, C, ...) of `arrays` (any dtype; each its own C and trailing shape),
 *  rows idx (B, H, K) (int32 or uint32) of it per (batch, head): out[b, h, k, ...] = a[b, h, idx[b, h, k], ...],
 *  (B, H, K, ...). An index outside [0, C) of an array gives a row of zeros there (never a read
 *  outside it). One primitive for all the arrays. */
std::vector<mx::array> take_rows(const std::vector<mx::array>& arrays, const mx::array& idx, mx::StreamOrDevice s = {});

/** Inputs: {the arrays, idx}; an output per array. */
class TakeRows : public ComposedPrimitive {
 public:
  explicit TakeRows(mx::Stream stream) : ComposedPrimitive(stream) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::array> composed(const std::vector<mx::array>& inputs) override;
  const char* name() const override { return "TakeRows"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
};

}  // namespace mlx_h2o
