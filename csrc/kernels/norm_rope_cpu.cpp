// The RMS-norm and RoPE kernels (norm_rope_cpu_impl.h), compiled once per instruction set
// (isa_variants.inc), and the run-time pick of the variant for this CPU.
#include "norm_rope_problem.h"

#define MLX_H2O_KERNEL_IMPL "norm_rope_cpu_impl.h"
#include "isa_variants.inc"

namespace mlx_h2o {

void rms_norm_cpu(const RMSNormProblem& p) { MLX_H2O_DISPATCH(rms_norm_cpu_entry, p); }

void rope_cpu(const RoPEProblem& p) { MLX_H2O_DISPATCH(rope_cpu_entry, p); }

}  // namespace mlx_h2o
