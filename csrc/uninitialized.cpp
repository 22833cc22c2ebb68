#include "uninitialized.h"

#include <stdexcept>

#include "mlx/allocator.h"

namespace mlx_h2o {

mx::array uninitialized(const mx::Shape& shape, mx::Dtype dtype, mx::StreamOrDevice s) {
  for (auto d : shape) {
    if (d < 0) throw std::invalid_argument("[uninitialized] shape must be non-negative");
  }
  // Never equivalent to another node: two reservations must not be merged by graph simplification.
  return mx::array(shape, dtype, std::make_shared<Uninitialized>(mx::to_stream(s)), {});
}

void Uninitialized::eval_cpu(const std::vector<mx::array>&, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
}

void Uninitialized::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[uninitialized] GPU streams are not supported; use a CPU stream.");
}

}  // namespace mlx_h2o
