// The primitive behind mlx-h2o's attention ops: fused attention over one or more key segments, each
// stored dense (float32/float16/bfloat16) or in MLX's packed affine format (2-8 bits), returning the
// output and the attention each key received, from one pass over K and V.
//
// Written to MLX's extension conventions (op functions, a Primitive with eval_cpu, bindings apart) so
// it could move into mlx::core::fast. The public single-segment ops
// (mlx_h2o.scaled_dot_product_attention_with_scores for dense K/V,
// mlx_h2o.quantized_scaled_dot_product_attention_with_scores for packed K/V) are this op with one
// segment (src/mlx_h2o/attention.py).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "composed_primitive.h"
#include "kernels/attention_problem.h"

namespace mlx_h2o {

namespace mx = mlx::core;

/** One of K or V of a segment: {dense} (B, Hkv, n, D), or {packed uint32, scales, biases} as
 *  mx::quantize returns them, with `bits` and `group_size`. `rows` >= 0 reads only the first `rows`
 *  rows of the arrays: a cache's buffers with spare room are read in place, without a slice
 *  primitive per array at every decode step; -1 reads all n. */
struct KVInput {
  std::vector<mx::array> arrays;
  int bits = 0, group_size = 0;
  int rows = -1;
  bool quantized() const { return arrays.size() == 3; }
};

struct SegmentInput {
  KVInput k, v;
};

/** A running per-key statistic (an h2o cache's score column) that the op folds its mass into:
 *  `acc` (B, Hkv, C) float32, C >= N, becomes accumulate_prefix(acc, mass, alpha, beta, held), an
 *  output of the attention primitive itself. A cache's decode step then has no primitive of its own
 *  for its score update: ~9 us each of a 2-core step, one per layer (docs/cpu-decode.md). */
struct ScoreColumn {
  mx::array acc;
  float alpha = 1.0f, beta = 1.0f;
  int held = 0;
};

/**
 * Attention of q (B, Hq, L, Dk) over the keys of `segments` taken in order (N = total length):
 * mask_mode "" (none), "causal" (query row i at absolute position N - L + i) or "array" with `mask`
 * boolean/additive, broadcastable to (B, Hq, L, N). scores "mass" -> (B, Hkv, N) float32 post-softmax
 * probability each key received, summed over the query heads of its kv group and the L rows;
 * "logits" -> (B, Hq, L, N) float32 masked logits; "" -> none. sinks: optional (Hq,) sink logits.
 * Returns {out (B, Hq, L, Dv) in q's dtype, scores} or {out}. CPU streams run the fused kernel; other
 * streams the composed ops of attention_with_scores_composed.
 *
 * For keys and values stored rotated (a rotated cache, storage/rotation.py): q_rotation, float32
 * (Dk, Dk), attends with q @ q_rotation in float32; out_rotation, float32 (Dv, Dv), returns the output
 * times it, in q's dtype. Both as rotate_rows computes them (float64 sums, rounded once), inside this
 * op: a rotated cache's step needs no rotate_rows primitive of its own for its queries and output.
 *
 * With a `column` (scores "mass" only): {out, scores, the column with the scores folded in}.
 */
std::vector<mx::array> attention_with_scores(const mx::array& q, const std::vector<SegmentInput>& segments, float scale,
                                             const std::string& mask_mode, const std::optional<mx::array>& mask,
                                             const std::string& scores, const std::optional<mx::array>& sinks,
                                             const std::optional<mx::array>& q_rotation = std::nullopt,
                                             const std::optional<mx::array>& out_rotation = std::nullopt,
                                             const std::optional<ScoreColumn>& column = std::nullopt,
                                             mx::StreamOrDevice s = {});

/** The same computation from stock MLX ops (dequantize, concatenate, matmul, softmax): the
 *  definition of the kernel, and its fallback off the CPU. */
std::vector<mx::array> attention_with_scores_composed(const mx::array& q, const std::vector<SegmentInput>& segments,
                                                      float scale, const std::string& mask_mode,
                                                      const std::optional<mx::array>& mask, const std::string& scores,
                                                      const std::optional<mx::array>& sinks,
                                                      const std::optional<mx::array>& q_rotation = std::nullopt,
                                                      const std::optional<mx::array>& out_rotation = std::nullopt,
                                                      const std::optional<ScoreColumn>& column = std::nullopt,
                                                      mx::StreamOrDevice s = {});

/** Whether new attention ops round the queries to int8 for packed 4-/8-bit keys (integer Q K^T; the
 *  default, MLX_H2O_ATTENTION_INT8=0 turns it off) or keep them float32. Read when an op is built. */
bool attention_int8_queries();
void set_attention_int8_queries(bool enabled);

struct SegmentFormat {
  int k_bits = 0, k_group_size = 0, v_bits = 0, v_group_size = 0;  // bits 0: dense
  int rows = -1;  // the leading rows of K and V read (KVInput::rows); -1: all
  bool operator==(const SegmentFormat& o) const {
    return k_bits == o.k_bits && k_group_size == o.k_group_size && v_bits == o.v_bits &&
           v_group_size == o.v_group_size && rows == o.rows;
  }
};

class AttentionWithScores : public ComposedPrimitive {
 public:
  /** How a score column is folded in (ScoreColumn less its array). */
  struct Fold {
    float alpha, beta;
    int held;
    bool operator==(const Fold& o) const { return alpha == o.alpha && beta == o.beta && held == o.held; }
  };

  // Inputs: q, each segment's K then V arrays, the mask (array mode), sinks, q_rotation, out_rotation,
  // the score column (those present, in that order).
  AttentionWithScores(mx::Stream stream, float scale, MaskKind mask_kind, ScoreMode score_mode, bool has_sinks,
                      std::vector<SegmentFormat> formats, bool int8_queries, bool q_rotated = false,
                      bool out_rotated = false, std::optional<Fold> fold = std::nullopt)
      : ComposedPrimitive(stream),
        scale_(scale),
        mask_kind_(mask_kind),
        score_mode_(score_mode),
        has_sinks_(has_sinks),
        formats_(std::move(formats)),
        int8_queries_(int8_queries),
        q_rotated_(q_rotated),
        out_rotated_(out_rotated),
        fold_(fold) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  // attention_with_scores_composed over this primitive's inputs (q, segment arrays, mask, sinks):
  // what vjp, jvp and vmap differentiate / map.
  std::vector<mx::array> composed(const std::vector<mx::array>& inputs) override;

  const char* name() const override { return "AttentionWithScores"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  float scale_;
  MaskKind mask_kind_;
  ScoreMode score_mode_;
  bool has_sinks_;
  std::vector<SegmentFormat> formats_;
  bool int8_queries_;
  bool q_rotated_, out_rotated_;
  std::optional<Fold> fold_;
};

}  // namespace mlx_h2o
