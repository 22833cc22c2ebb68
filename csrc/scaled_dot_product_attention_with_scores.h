// scaled_dot_product_attention_with_scores: attention that also returns the attention each cached
// position received, from the same pass over K and V (the score export H2O-style caches need).
//
// Written to MLX's extension conventions (an op function, a Primitive with eval_cpu, bindings
// elsewhere) so it could move into mlx::core::fast.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "kernels/attention_problem.h"

namespace mlx_h2o {

namespace mx = mlx::core;

/**
 * q: (B, Hq, L, Dk); k: (B, Hkv, N, Dk); v: (B, Hkv, N, Dv); Hq a multiple of Hkv.
 * mask_mode: "" (none), "causal" (query row i at absolute position N - L + i) or "array" with
 * `mask` a boolean or additive array broadcastable to (B, Hq, L, N).
 * scores: "mass" -> (B, Hkv, N) float32, the post-softmax probability each position received, summed
 * over the query heads of its kv group and the L rows; "logits" -> (B, Hq, L, N) float32 masked
 * pre-softmax logits; "" -> no scores.
 * sinks: optional (Hq,) per-head sink logits (an extra softmax column without a value).
 * Returns {out (B, Hq, L, Dv) in q's dtype, scores} or {out}.
 * CPU streams run the fused kernel; other streams run the composed ops of
 * attention_with_scores_composed (correct, unfused).
 */
std::vector<mx::array> scaled_dot_product_attention_with_scores(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    float scale,
    const std::string& mask_mode = "",
    const std::optional<mx::array>& mask = std::nullopt,
    const std::string& scores = "mass",
    const std::optional<mx::array>& sinks = std::nullopt,
    mx::StreamOrDevice s = {});

/** The same computation from stock MLX ops (the definition, and the fallback off the CPU). */
std::vector<mx::array> attention_with_scores_composed(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    float scale,
    const std::string& mask_mode = "",
    const std::optional<mx::array>& mask = std::nullopt,
    const std::string& scores = "mass",
    const std::optional<mx::array>& sinks = std::nullopt,
    mx::StreamOrDevice s = {});

class ScaledDotProductAttentionWithScores : public mx::Primitive {
 public:
  ScaledDotProductAttentionWithScores(mx::Stream stream, float scale, MaskKind mask_kind, ScoreMode score_mode,
                                      bool has_sinks)
      : mx::Primitive(stream), scale_(scale), mask_kind_(mask_kind), score_mode_(score_mode), has_sinks_(has_sinks) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override { return "ScaledDotProductAttentionWithScores"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  float scale_;
  MaskKind mask_kind_;
  ScoreMode score_mode_;
  bool has_sinks_;
};

/** Validation shared by the dense and quantized ops; throws std::invalid_argument. */
struct AttentionArgs {
  MaskKind mask_kind;
  ScoreMode score_mode;
};
AttentionArgs check_attention_args(const char* op, const mx::array& q, int B, int Hkv, int N, int Dk, float scale,
                                   const std::string& mask_mode, const std::optional<mx::array>& mask,
                                   const std::string& scores, const std::optional<mx::array>& sinks);

/** Fills the q / mask / sinks / output parts of an AttentionProblem from evaluated arrays. */
void fill_common_problem(AttentionProblem& p, const std::vector<mx::array>& inputs, int first_optional,
                         MaskKind mask_kind, bool has_sinks, ScoreMode score_mode, std::vector<mx::array>& outputs);

/** A View4 of an evaluated array (strides in elements). */
View4 view_of(const mx::array& a);

}  // namespace mlx_h2o
