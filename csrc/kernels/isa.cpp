#include "isa.h"

#include <cstdlib>
#include <cstring>
#include <new>

namespace mlx_h2o {

KernelIsa kernel_isa() {
#if defined(__x86_64__) || defined(_M_X64)
  static const KernelIsa isa = [] {
    __builtin_cpu_init();
    const bool avx2 =
        __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    // The 256-bit forms of vpdpbusd are AVX512-VNNI + AVX512VL (EVEX): Ice Lake and later Xeons, Zen 4.
    const bool vnni = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
    KernelIsa best = vnni ? KernelIsa::avx512vnni : avx2 ? KernelIsa::avx2 : KernelIsa::portable;
    if (const char* env = std::getenv("MLX_H2O_KERNEL_ISA")) {
      if (std::strcmp(env, "portable") == 0) return KernelIsa::portable;
      if (std::strcmp(env, "avx2") == 0 && avx2) return KernelIsa::avx2;
    }
    return best;
  }();
  return isa;
#else
  return KernelIsa::portable;
#endif
}

const char* kernel_isa_name() {
  switch (kernel_isa()) {
    case KernelIsa::avx512vnni: return "avx2+fma+f16c+avx512vnni";
    case KernelIsa::avx2: return "avx2+fma+f16c";
    default: return "portable";
  }
}

void throw_out_of_memory() { throw std::bad_alloc(); }

}  // namespace mlx_h2o
