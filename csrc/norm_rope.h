// rms_norm and rope: mx.fast.rms_norm / mx.fast.rope as one CPU kernel each. On the CPU MLX runs both
// fast ops as their composed fallbacks (11 and 29 primitives a call); with two of each per layer that
// is most of a decode step's primitives, each paying dispatch. Other streams run mx.fast's own ops,
// which are also these primitives' definition (for vjp, jvp and vmap).
#pragma once

#include <optional>
#include <vector>

#include "mlx/ops.h"

#include "composed_primitive.h"

namespace mlx_h2o {

namespace mx = mlx::core;

/** mx.fast.rms_norm(x, weight, eps): x (..., D), weight (D,) or none; same result dtype. */
mx::array rms_norm(const mx::array& x, const std::optional<mx::array>& weight, float eps, mx::StreamOrDevice s = {});

/** mx.fast.rope(x, dims, traditional, base, scale, offset) for an integer offset: x (B, H, L, D) or
 *  (B, L, D), any strides; dims even, <= D. */
mx::array rope(const mx::array& x, int dims, bool traditional, float base, float scale, int offset,
               mx::StreamOrDevice s = {});

/**
 * A packed projection of groups of heads (a packed q/k/v product) as the attention's arrays: x (B, L,
 * sum(heads) * head_dim) holds `heads.size()` groups of heads side by side along its last axis; group
 * i comes out as (B, heads[i], L, head_dim), the first `rotated` groups through rope(..., dims,
 * traditional, base, scale, offset), the others as they are. `dtypes` (one per group, or empty: x's
 * dtype for all) are the groups' output dtypes: a cache that keeps its rows in float16 gets its keys
 * and values in float16 from here, where a cast of each would be two more primitives a layer.
 * Groups in another dtype than x's need float32 x, and hold the bits of the float32 group cast to
 * their dtype. On CPU streams one primitive where the reshape, transpose, splits,
 * RoPE calls and casts were 4-12; elsewhere (and as its definition) those ops.
 */
std::vector<mx::array> split_heads_rope(const mx::array& x, const std::vector<int>& heads, int head_dim, int rotated,
                                        int dims, bool traditional, float base, float scale, int offset,
                                        const std::vector<mx::Dtype>& dtypes = {}, mx::StreamOrDevice s = {});

class RMSNormCPU : public ComposedPrimitive {
 public:
  RMSNormCPU(mx::Stream stream, float eps, bool has_weight) : ComposedPrimitive(stream), eps_(eps), has_weight_(has_weight) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::array> composed(const std::vector<mx::array>& inputs) override;
  const char* name() const override { return "RMSNormCPU"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }

 private:
  float eps_;
  bool has_weight_;
};

class RoPECPU : public ComposedPrimitive {
 public:
  RoPECPU(mx::Stream stream, int dims, bool traditional, float base, float scale, int offset)
      : ComposedPrimitive(stream), dims_(dims), traditional_(traditional), base_(base), scale_(scale), offset_(offset) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::array> composed(const std::vector<mx::array>& inputs) override;
  const char* name() const override { return "RoPECPU"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }

 private:
  int dims_;
  bool traditional_;
  float base_, scale_;
  int offset_;
};

class SplitHeadsRoPE : public ComposedPrimitive {
 public:
  SplitHeadsRoPE(mx::Stream stream, std::vector<int> heads, int head_dim, int rotated, int dims, bool traditional,
                 float base, float scale, int offset, std::vector<mx::Dtype> dtypes)
      : ComposedPrimitive(stream), heads_(std::move(heads)), head_dim_(head_dim), rotated_(rotated), dims_(dims),
        traditional_(traditional), base_(base), scale_(scale), offset_(offset), dtypes_(std::move(dtypes)) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::array> composed(const std::vector<mx::array>& inputs) override;
  const char* name() const override { return "SplitHeadsRoPE"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  std::vector<int> heads_;
  int head_dim_, rotated_, dims_;
  bool traditional_;
  float base_, scale_;
  int offset_;
  std::vector<mx::Dtype> dtypes_;  // one per group
};

}  // namespace mlx_h2o
