// Element types the CPU kernels read and write, and strided views (plain C++: no MLX types in the
// kernels).
#pragma once

#include <cstdint>

namespace mlx_h2o {

enum class ElemType : int { float32 = 0, float16 = 1, bfloat16 = 2, boolean = 3 };

/** A strided 4-D view; strides are in elements. */
struct View4 {
  const void* data = nullptr;
  ElemType type = ElemType::float32;
  int64_t stride[4] = {0, 0, 0, 0};
};

}  // namespace mlx_h2o
