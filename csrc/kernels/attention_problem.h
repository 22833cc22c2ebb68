// Plain-data description of one attention call for the CPU kernels (no MLX types: the kernels are
// compiled once per instruction set and must not instantiate shared templates, see attention_cpu.cpp).
#pragma once

#include <cstdint>

namespace mlx_h2o {

enum class ElemType : int { float32 = 0, float16 = 1, bfloat16 = 2, boolean = 3 };
enum class MaskKind : int { none = 0, causal = 1, array = 2 };
enum class ScoreMode : int { none = 0, mass = 1, logits = 2 };

/** A strided 4-D view; strides are in elements. */
struct View4 {
  const void* data = nullptr;
  ElemType type = ElemType::float32;
  int64_t stride[4] = {0, 0, 0, 0};
};

/** MLX's affine quantization of one of K / V: weights packed along the last axis into uint32
 *  (bits 4 or 8), one scale and bias per `group_size` elements. View strides: `packed` in uint32
 *  words, `scales` / `biases` in elements; their last-axis stride is 1. */
struct QuantizedView {
  View4 packed, scales, biases;
};

struct AttentionProblem {
  int B = 0, Hq = 0, Hkv = 0, L = 0, N = 0, Dk = 0, Dv = 0;
  float scale = 1.0f;
  View4 q;
  // Dense K/V: k, v with a unit stride on the last axis. Quantized K/V: kq, vq with bits/group_size.
  View4 k, v;
  bool quantized = false;
  QuantizedView kq, vq;
  int bits = 0, group_size = 0;
  MaskKind mask_kind = MaskKind::none;
  View4 mask;  // broadcast to (B, Hq, L, N) (zero strides allowed); boolean or additive
  const void* sinks = nullptr;  // (Hq,) sink logits, or null
  ElemType sinks_type = ElemType::float32;
  int64_t sinks_stride = 1;
  void* out = nullptr;  // (B, Hq, L, Dv), contiguous, element type out_type
  ElemType out_type = ElemType::float32;
  ScoreMode score_mode = ScoreMode::none;
  float* scores = nullptr;  // mass: (B, Hkv, N); logits: (B, Hq, L, N); contiguous float32
  int threads = 1;
};

/** Runs the fused kernel for the best instruction set this CPU supports. */
void attention_cpu(const AttentionProblem& p);

/** Which kernel variant attention_cpu() runs on this machine (e.g. "avx2+fma+f16c", "generic"). */
const char* attention_cpu_isa();

}  // namespace mlx_h2o
