#include "isa.h"

#include <cstdlib>
#include <new>

namespace mlx_h2o {

KernelIsa kernel_isa() {
#if defined(__x86_64__) || defined(_M_X64)
  static const KernelIsa isa = [] {
    if (const char* env = std::getenv("MLX_H2O_KERNEL_ISA")) {
      if (env[0] == 'p') return KernelIsa::portable;
    }
    __builtin_cpu_init();
    const bool avx2 =
        __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    return avx2 ? KernelIsa::avx2 : KernelIsa::portable;
  }();
  return isa;
#else
  return KernelIsa::portable;
#endif
}

const char* kernel_isa_name() { return kernel_isa() == KernelIsa::avx2 ? "avx2+fma+f16c" : "portable"; }

void throw_out_of_memory() { throw std::bad_alloc(); }

}  // namespace mlx_h2o
