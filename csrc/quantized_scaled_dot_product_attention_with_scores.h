// quantized_scaled_dot_product_attention_with_scores: the same fused attention and score export,
// reading K and V in MLX's packed affine format (as mx::quantize returns them) and dequantizing in
// registers, so the cache is read at its packed size.
#pragma once

#include "attention_with_scores.h"

namespace mlx_h2o {

/**
 * q: (B, Hq, L, D); k_q / v_q: {packed uint32 (B, Hkv, N, D * bits / 32), scales, biases
 * (B, Hkv, N, D / group_size)}; bits 2, 3, 4, 5, 6 or 8; group_size 32, 64 or 128. Masks, scores
 * and sinks as in scaled_dot_product_attention_with_scores.
 */
std::vector<mx::array> quantized_scaled_dot_product_attention_with_scores(
    const mx::array& q, const std::vector<mx::array>& k_q, const std::vector<mx::array>& v_q, float scale, int bits,
    int group_size, const std::string& mask_mode = "", const std::optional<mx::array>& mask = std::nullopt,
    const std::string& scores = "mass", const std::optional<mx::array>& sinks = std::nullopt,
    mx::StreamOrDevice s = {});

}  // namespace mlx_h2o
