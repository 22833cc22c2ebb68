// Element types the CPU kernels read and write (plain C++: no MLX types in the kernels).
#pragma once

namespace mlx_h2o {

enum class ElemType : int { float32 = 0, float16 = 1, bfloat16 = 2, boolean = 3 };

}  // namespace mlx_h2o
