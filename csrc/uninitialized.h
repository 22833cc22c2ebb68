// An array whose memory is allocated but never written: untouched pages stay uncommitted,
// so a large reservation costs address space, not RSS, until tokens are written into it.
#pragma once

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mlx_h2o {

namespace mx = mlx::core;

/** Allocate an array of `shape` and `dtype` without initialising its contents. */
mx::array uninitialized(const mx::Shape& shape, mx::Dtype dtype, mx::StreamOrDevice s = {});

class Uninitialized : public mx::UnaryPrimitive {
 public:
  Uninitialized(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override { return "Uninitialized"; }
  bool is_equivalent(const mx::Primitive& other) const override { return false; }
};

}  // namespace mlx_h2o
