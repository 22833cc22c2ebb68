// The SwiGLU activation kernel (activation_cpu_impl.h), compiled once per instruction set
// (isa_variants.inc), and the run-time pick of the variant for this CPU.
#include "activation_problem.h"

#define MLX_H2O_KERNEL_IMPL "activation_cpu_impl.h"
#include "isa_variants.inc"

namespace mlx_h2o {

void swiglu_cpu(const SwiGLUProblem& p) { MLX_H2O_DISPATCH(swiglu_cpu_entry, p); }

}  // namespace mlx_h2o
