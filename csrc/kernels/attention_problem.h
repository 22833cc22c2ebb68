// Plain-data description of one attention call for the CPU kernels (no MLX types: the kernels are
// compiled once per instruction set and must not instantiate shared templates, see attention_cpu.cpp).
#pragma once

#include <cstdint>

#include "elem_type.h"

namespace mlx_h2o {

enum class MaskKind : int { none = 0, causal = 1, array = 2 };
enum class ScoreMode : int { none = 0, mass = 1, logits = 2 };

/** One of K or V for one segment of keys. Dense: `dense` (float32/float16/bfloat16, unit stride on
 *  the last axis). Quantized (MLX's affine format): `packed` holds uint32 words of a little-endian bit
 *  stream of `bits`-bit values (element j at bit j * bits of its row), `scales` / `biases` one value
 *  per `group_size` elements; all three with a unit last-axis stride. */
struct KVSource {
  bool quantized = false;
  View4 dense;
  View4 packed, scales, biases;
  int bits = 0, group_size = 0;
};

/** Keys [begin, begin + length) of the logical sequence, stored in their own format. A call may
 *  attend over several segments (e.g. 8-bit heavy hitters + a 4-bit recent window, or packed
 *  storage + a full-precision residual window) without concatenating them. */
struct KVSegment {
  int begin = 0, length = 0;
  KVSource k, v;
};

constexpr int MAX_SEGMENTS = 4;

struct AttentionProblem {
  int B = 0, Hq = 0, Hkv = 0, L = 0, N = 0, Dk = 0, Dv = 0;
  float scale = 1.0f;
  View4 q;
  KVSegment segments[MAX_SEGMENTS];
  int n_segments = 0;
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
  // Q K^T against packed 4-/8-bit keys in integer arithmetic: each query row rounded to int8 per 32
  // values (as quantized_matmul does with activations); off: queries stay float32.
  bool int8_queries = true;
};

/** Runs the fused kernel for the best instruction set this CPU supports. */
void attention_cpu(const AttentionProblem& p);

}  // namespace mlx_h2o
