// The fused attention kernel (attention_cpu_impl.h), compiled once per instruction set
// (isa_variants.inc), and the run-time pick of the variant for this CPU.
#include "attention_problem.h"

#define MLX_H2O_KERNEL_IMPL "attention_cpu_impl.h"
#include "isa_variants.inc"

namespace mlx_h2o {

void attention_cpu(const AttentionProblem& p) {
#if defined(MLX_H2O_HAVE_AVX2_VARIANT)
  if (kernel_isa() == KernelIsa::avx2) return avx2::attention_cpu_entry(p);
#endif
  portable::attention_cpu_entry(p);
}

}  // namespace mlx_h2o
