// Which instruction-set variant of the CPU kernels runs on this machine, and the few functions the
// per-ISA kernel code calls outside its own namespace (declared here, compiled once, in isa.cpp).
#pragma once

namespace mlx_h2o {

enum class KernelIsa : int { portable = 0, avx2 = 1, avx512vnni = 2 };

/** The best variant this CPU supports. MLX_H2O_KERNEL_ISA=portable / avx2 asks for an older one (for
 *  tests and A/B runs); a variant the CPU lacks is never picked. */
KernelIsa kernel_isa();

/** Its name: "portable", "avx2+fma+f16c" or "avx2+fma+f16c+avx512vnni". */
const char* kernel_isa_name();

/** Thrown by the kernels' scratch allocations (kept out of the per-ISA code: no exception type is
 *  instantiated there). */
[[noreturn]] void throw_out_of_memory();

}  // namespace mlx_h2o
