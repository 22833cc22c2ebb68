// accumulate_prefix: a running per-entry statistic (an h2o cache's attention score column) folded
// with one attention call's statistics in one pass.
//
// A cache that ranks its entries keeps a float32 column (B, H, capacity) and updates its first N
// entries after every attention call: a <- alpha * a + beta * x. As stock ops that is a slice, two
// multiplies, an add and a slice_update per layer and call, each a primitive MLX schedules on its
// own; at decode they were most of an h2o step's extra primitives. One primitive does the same
// arithmetic and writes in place when MLX can donate the column's buffer.
#pragma once

#include <vector>

#include "mlx/ops.h"

#include "composed_primitive.h"

namespace mlx_h2o {

namespace mx = mlx::core;

/** ValueError unless accumulate_prefix takes (acc, x, held). */
void check_accumulate(const mx::array& acc, const mx::array& x, int held);

/** The CPU loop behind accumulate_prefix: `rows` rows of acc (C floats each) and x (N), into out
 *  (C each); out may be acc itself (in place: its entries [N, C) are then left as they are). */
void accumulate_prefix_rows(const float* acc, const float* x, float* out, int64_t rows, int64_t C, int64_t N, int64_t held,
                            float alpha, float beta);

/** `acc` (..., C) float32 with its first N entries along the last axis replaced by
 *  alpha * acc[..., i] + beta * x[..., i], where x is (..., N) float32 with acc's leading shape and
 *  N <= C. Entries at or past `held` (0 <= held <= C) are read as 0: entries appended since the
 *  column was last written, whose statistic starts at 0. Entries [N, C) are unchanged. */
mx::array accumulate_prefix(const mx::array& acc, const mx::array& x, float alpha, float beta, int held,
                            mx::StreamOrDevice s = {});

/** accumulate_prefix, and `along` (any array) passed through: {the updated column, along's values in
 *  along's buffer}. The two are outputs of one primitive, so evaluating the second evaluates the
 *  first: an attention output passed along carries its layer's score update, where a Depends
 *  primitive per layer and decode step did. (Two outputs: the column is not updated in place, a
 *  copy of C floats per row.) */
std::vector<mx::array> accumulate_prefix_along(const mx::array& acc, const mx::array& x, float alpha, float beta, int held,
                                               const mx::array& along, mx::StreamOrDevice s = {});

class AccumulatePrefix : public ComposedPrimitive {
 public:
  AccumulatePrefix(mx::Stream stream, float alpha, float beta, int held)
      : ComposedPrimitive(stream), alpha_(alpha), beta_(beta), held_(held) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::array> composed(const std::vector<mx::array>& inputs) override;
  const char* name() const override { return "AccumulatePrefix"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  float alpha_, beta_;
  int held_;
};

}  // namespace mlx_h2o
