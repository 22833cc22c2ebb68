// The SwiGLU and logsumexp kernels (exp_ops_cpu_impl.h), compiled once per instruction set
// (isa_variants.inc), and the run-time pick of the variant for this CPU.
#include "exp_ops_problem.h"

#define MLX_H2O_KERNEL_IMPL "exp_ops_cpu_impl.h"
#include "isa_variants.inc"

namespace mlx_h2o {

void swiglu_cpu(const SwiGLUProblem& p) { MLX_H2O_DISPATCH(swiglu_cpu_entry, p); }

void logsumexp_cpu(const LogSumExpProblem& p) { MLX_H2O_DISPATCH(logsumexp_cpu_entry, p); }

}  // namespace mlx_h2o
