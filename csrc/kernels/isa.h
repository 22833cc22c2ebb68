// Which instruction-set variant of the CPU kernels runs on this machine, and the few functions the
// per-ISA kernel code calls outside its own namespace (declared here, compiled once, in isa.cpp).
#pragma once

namespace mlx_h2o {

enum class KernelIsa : int { portable = 0, avx2 = 1 };

/** The best variant this CPU supports; MLX_H2O_KERNEL_ISA=portable forces the portable one. */
KernelIsa kernel_isa();

/** Its name, e.g. "avx2+fma+f16c" or "portable". */
const char* kernel_isa_name();

/** Thrown by the kernels' scratch allocations (kept out of the per-ISA code: no exception type is
 *  instantiated there). */
[[noreturn]] void throw_out_of_memory();

}  // namespace mlx_h2o
