// Compiles the fused attention kernel (attention_cpu_impl.h) once per instruction set and picks the
// best one for the running CPU: a portable build (GCC/Clang vector extensions: SSE2 on x86-64, NEON
// on arm64) and, on x86-64, an AVX2 + FMA + F16C build. Both live in this one translation unit, each
// in its own namespace, so no symbol compiled for AVX2 can be picked by the linker for the portable
// path (which is what goes wrong when two files built with different -m flags share inline code).
#include "attention_problem.h"

#include <cstdint>
#include <cstdlib>
#include <new>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MLX_H2O_HAVE_AVX2_VARIANT 1
#endif

#include "../parallel.h"

namespace mlx_h2o {

[[noreturn]] static void throw_out_of_memory() { throw std::bad_alloc(); }

}  // namespace mlx_h2o

#define MLX_H2O_ISA_NS portable
#include "attention_cpu_impl.h"
#undef MLX_H2O_ISA_NS

#if defined(MLX_H2O_HAVE_AVX2_VARIANT)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
#define MLX_H2O_ISA_NS avx2
#define MLX_H2O_ISA_AVX2 1
#include "attention_cpu_impl.h"
#undef MLX_H2O_ISA_AVX2
#undef MLX_H2O_ISA_NS
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif

namespace mlx_h2o {

namespace {

bool cpu_has_avx2() {
#if defined(MLX_H2O_HAVE_AVX2_VARIANT)
  static const bool has = [] {
    if (const char* env = std::getenv("MLX_H2O_KERNEL_ISA")) {
      if (env[0] == 'p') return false;  // MLX_H2O_KERNEL_ISA=portable forces the portable build
    }
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  }();
  return has;
#else
  return false;
#endif
}

}  // namespace

void attention_cpu(const AttentionProblem& p) {
#if defined(MLX_H2O_HAVE_AVX2_VARIANT)
  if (cpu_has_avx2()) return avx2::attention_cpu_entry(p);
#endif
  portable::attention_cpu_entry(p);
}

const char* attention_cpu_isa() { return cpu_has_avx2() ? "avx2+fma+f16c" : "portable"; }

}  // namespace mlx_h2o
