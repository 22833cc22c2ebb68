#include "scaled_dot_product_attention_with_scores.h"

namespace mlx_h2o {

std::vector<mx::array> scaled_dot_product_attention_with_scores(const mx::array& q, const mx::array& k,
                                                                const mx::array& v, float scale,
                                                                const std::string& mask_mode,
                                                                const std::optional<mx::array>& mask,
                                                                const std::string& scores,
                                                                const std::optional<mx::array>& sinks,
                                                                mx::StreamOrDevice s) {
  return attention_with_scores(q, {SegmentInput{KVInput{{k}}, KVInput{{v}}}}, scale, mask_mode, mask, scores, sinks, s);
}

}  // namespace mlx_h2o
