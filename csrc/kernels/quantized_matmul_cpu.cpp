// The packed-weight matmul and dequantize kernels (quantized_matmul_cpu_impl.h), compiled once per instruction set
// (isa_variants.inc), and the run-time pick of the variant for this CPU.
#include "quantized_matmul_problem.h"

#define MLX_H2O_KERNEL_IMPL "quantized_matmul_cpu_impl.h"
#include "isa_variants.inc"

namespace mlx_h2o {

void quantized_matmul_cpu(const QuantizedMatmulProblem& p) {
#if defined(MLX_H2O_HAVE_AVX2_VARIANT)
  if (kernel_isa() == KernelIsa::avx2) return avx2::quantized_matmul_cpu_entry(p);
#endif
  portable::quantized_matmul_cpu_entry(p);
}

void dequantize_cpu(const DequantizeProblem& p) {
#if defined(MLX_H2O_HAVE_AVX2_VARIANT)
  if (kernel_isa() == KernelIsa::avx2) return avx2::dequantize_cpu_entry(p);
#endif
  portable::dequantize_cpu_entry(p);
}

}  // namespace mlx_h2o
