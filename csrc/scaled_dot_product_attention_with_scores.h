// scaled_dot_product_attention_with_scores: attention that also returns the attention each cached
// position received, from the same pass over K and V (the score export H2O-style caches need).
#pragma once

#include "attention_with_scores.h"

namespace mlx_h2o {

/**
 * q: (B, Hq, L, Dk); k: (B, Hkv, N, Dk); v: (B, Hkv, N, Dv); Hq a multiple of Hkv; float32, float16
 * or bfloat16. mask_mode "", "causal" or "array" (with `mask`); scores "mass", "logits" or "";
 * optional (Hq,) sinks. Returns {out, scores} or {out}: see attention_with_scores().
 */
std::vector<mx::array> scaled_dot_product_attention_with_scores(
    const mx::array& q, const mx::array& k, const mx::array& v, float scale, const std::string& mask_mode = "",
    const std::optional<mx::array>& mask = std::nullopt, const std::string& scores = "mass",
    const std::optional<mx::array>& sinks = std::nullopt, mx::StreamOrDevice s = {});

}  // namespace mlx_h2o
