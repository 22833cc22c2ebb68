#include "quantized_scaled_dot_product_attention_with_scores.h"

#include <stdexcept>

namespace mlx_h2o {

std::vector<mx::array> quantized_scaled_dot_product_attention_with_scores(
    const mx::array& q, const std::vector<mx::array>& k_q, const std::vector<mx::array>& v_q, float scale, int bits,
    int group_size, const std::string& mask_mode, const std::optional<mx::array>& mask, const std::string& scores,
    const std::optional<mx::array>& sinks, mx::StreamOrDevice s) {
  if (k_q.size() != 3 || v_q.size() != 3)
    throw std::invalid_argument("k_q and v_q must each be a (packed, scales, biases) triple as mx.quantize returns");
  return attention_with_scores(q, {SegmentInput{KVInput{k_q, bits, group_size}, KVInput{v_q, bits, group_size}}},
                               scale, mask_mode, mask, scores, sinks, s);
}

}  // namespace mlx_h2o
