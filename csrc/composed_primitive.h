// A primitive whose CPU kernel computes what a composition of stock MLX ops defines, and which takes
// its derivatives and vmap from that composition (the role mlx::core::fast::Custom plays for MLX's own
// fused ops; that class is not exported by libmlx, so extensions need their own).
#pragma once

#include <functional>
#include <utility>
#include <vector>

#include "mlx/primitives.h"

namespace mlx_h2o {

namespace mx = mlx::core;

class ComposedPrimitive : public mx::Primitive {
 public:
  explicit ComposedPrimitive(mx::Stream stream) : mx::Primitive(stream) {}

  /** The stock-ops definition of the outputs from this primitive's inputs. */
  virtual std::vector<mx::array> composed(const std::vector<mx::array>& inputs) = 0;

  // Only the argnums are variables: the other inputs (packed words, boolean masks) stay constants,
  // so no derivative is asked of an op that has none.
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>& outputs) override;
  std::vector<mx::array> jvp(const std::vector<mx::array>& primals, const std::vector<mx::array>& tangents,
                             const std::vector<int>& argnums) override;
  std::pair<std::vector<mx::array>, std::vector<int>> vmap(const std::vector<mx::array>& inputs,
                                                          const std::vector<int>& axes) override;

 private:
  // composed() as a function of the inputs at `argnums`, the others fixed to `primals`.
  std::function<std::vector<mx::array>(const std::vector<mx::array>&)> composed_in(
      const std::vector<mx::array>& primals, const std::vector<int>& argnums);
};

}  // namespace mlx_h2o
