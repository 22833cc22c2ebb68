// Two ops on the vectorized-exp kernels (kernels/exp_ops_problem.h), each one CPU primitive:
// - swiglu: silu(gate) * up, the gated activation of a SwiGLU MLP. mlx-lm computes it with an
//   mx.compile'd function, which on the CPU is a JIT-compiled loop of scalar exp calls;
// - logsumexp over the last axis (what the fork's MLX runs for mx.logsumexp's contiguous rows).
// Other streams run the stock ops, which are also the primitives' definition (vjp, jvp, vmap).
#pragma once

#include <vector>

#include "mlx/ops.h"

#include "composed_primitive.h"

namespace mlx_h2o {

namespace mx = mlx::core;

/** gate * sigmoid(gate) * up: gate and up of one shape and one float dtype; the result has both. */
mx::array swiglu(const mx::array& gate, const mx::array& up, mx::StreamOrDevice s = {});

/** swiglu of the halves of x's last axis, gate then up (a packed gate/up product), without taking
 *  them apart first: x of a float dtype with an even, non-zero last axis; the result has half of it. */
mx::array swiglu_halves(const mx::array& x, mx::StreamOrDevice s = {});

/** mx.logsumexp(x, axis=-1): x a float array with a non-empty last axis. */
mx::array logsumexp_last_axis(const mx::array& x, mx::StreamOrDevice s = {});

/** inputs: (gate, up), or (x) with gate and up the halves of x's last axis (`halves`). */
class SwiGLUCPU : public ComposedPrimitive {
 public:
  explicit SwiGLUCPU(mx::Stream stream, bool halves = false) : ComposedPrimitive(stream), halves_(halves) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::array> composed(const std::vector<mx::array>& inputs) override;
  const char* name() const override { return "SwiGLUCPU"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return halves_ == static_cast<const SwiGLUCPU&>(other).halves_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  bool halves_;
};

class LogSumExpCPU : public ComposedPrimitive {
 public:
  explicit LogSumExpCPU(mx::Stream stream) : ComposedPrimitive(stream) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::array> composed(const std::vector<mx::array>& inputs) override;
  const char* name() const override { return "LogSumExpCPU"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.pop_back();
    return {shape};
  }
};

}  // namespace mlx_h2o
