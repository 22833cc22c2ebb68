// The fused attention kernel (attention_cpu_impl.h), compiled once per instruction set
// (isa_variants.inc), and the run-time pick of the variant for this CPU.
#include "attention_problem.h"

#define MLX_H2O_KERNEL_IMPL "attention_cpu_impl.h"
#include "isa_variants.inc"

namespace mlx_h2o {

void attention_cpu(const AttentionProblem& p) { MLX_H2O_DISPATCH(attention_cpu_entry, p); }

}  // namespace mlx_h2o
