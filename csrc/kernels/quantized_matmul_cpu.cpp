// The packed-weight matmul and dequantize kernels (quantized_matmul_cpu_impl.h), compiled once per instruction set
// (isa_variants.inc), and the run-time pick of the variant for this CPU.
#include "quantized_matmul_problem.h"

#define MLX_H2O_KERNEL_IMPL "quantized_matmul_cpu_impl.h"
#include "isa_variants.inc"

namespace mlx_h2o {

void quantized_matmul_cpu(const QuantizedMatmulProblem& p) { MLX_H2O_DISPATCH(quantized_matmul_cpu_entry, p); }

void dequantize_cpu(const DequantizeProblem& p) { MLX_H2O_DISPATCH(dequantize_cpu_entry, p); }

}  // namespace mlx_h2o
