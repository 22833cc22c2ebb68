// top_rows: which entries an eviction keeps, per (batch, head), in one pass.
//
// An h2o compaction ranks a layer's entries per kv head (protected ones at +inf, dead rows at -inf)
// and keeps the `count` best in position order. As stock ops that was an argpartition, a slice, a
// sort of the kept indices and a pad to the buffers' capacity: ~70 µs of a decode step on a 2-core
// CPU at M = 512 (MLX's CPU sort dominates). Here one primitive selects them (nth_element) and writes
// them ascending with the padding, and ties go to the older entry, as the written-out rule in the
// tests has it.
#pragma once

#include <vector>

#include "mlx/ops.h"

#include "composed_primitive.h"

namespace mlx_h2o {

namespace mx = mlx::core;

/** key (..., P) float32 -> (..., capacity) int32: per row, the indices of its `count` largest keys
 *  (ties: the lower index; NaN ranks as -inf), ascending, then `capacity - count` zeros.
 *  1 <= count <= P, capacity >= count (-1: count). */
mx::array top_rows(const mx::array& key, int count, int capacity = -1, mx::StreamOrDevice s = {});

class TopRows : public ComposedPrimitive {
 public:
  TopRows(mx::Stream stream, int count, int capacity) : ComposedPrimitive(stream), count_(count), capacity_(capacity) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  /** argsort's order, which may break ties otherwise than the CPU kernel. */
  std::vector<mx::array> composed(const std::vector<mx::array>& inputs) override;
  const char* name() const override { return "TopRows"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  int count_, capacity_;
};

}  // namespace mlx_h2o
