#include "composed_primitive.h"

#include "mlx/transforms.h"

namespace mlx_h2o {

namespace {

std::vector<mx::array> select(const std::vector<mx::array>& a, const std::vector<int>& argnums) {
  std::vector<mx::array> out;
  for (int i : argnums) out.push_back(a[i]);
  return out;
}

}  // namespace

std::function<std::vector<mx::array>(const std::vector<mx::array>&)> ComposedPrimitive::composed_in(
    const std::vector<mx::array>& primals, const std::vector<int>& argnums) {
  return [this, primals, argnums](const std::vector<mx::array>& x) {
    std::vector<mx::array> all = primals;
    for (size_t j = 0; j < argnums.size(); ++j) all[argnums[j]] = x[j];
    return composed(all);
  };
}

std::vector<mx::array> ComposedPrimitive::vjp(const std::vector<mx::array>& primals,
                                              const std::vector<mx::array>& cotangents,
                                              const std::vector<int>& argnums, const std::vector<mx::array>&) {
  return mx::vjp(composed_in(primals, argnums), select(primals, argnums), cotangents).second;
}

std::vector<mx::array> ComposedPrimitive::jvp(const std::vector<mx::array>& primals,
                                              const std::vector<mx::array>& tangents,
                                              const std::vector<int>& argnums) {
  return mx::jvp(composed_in(primals, argnums), select(primals, argnums), tangents).second;
}

std::pair<std::vector<mx::array>, std::vector<int>> ComposedPrimitive::vmap(const std::vector<mx::array>& inputs,
                                                                            const std::vector<int>& axes) {
  auto outputs = mx::vmap([this](const std::vector<mx::array>& x) { return composed(x); }, axes)(inputs);
  return {outputs, std::vector<int>(outputs.size(), 0)};
}

}  // namespace mlx_h2o
