// Routes the three CBLAS entry points libmlx imports (cblas_sgemm/dgemm/cgemm) to the OpenBLAS that
// NumPy's wheels bundle (ILP64, symbols prefixed `scipy_` and suffixed `64_`).
//
// Why: the mlx-cpu wheel links a reference BLAS (fp32 GEMM ~4 GFLOP/s on a 2-core x86 machine);
// OpenBLAS runs the same GEMM at ~170 GFLOP/s, bit-for-bit a correct sgemm. Loaded with RTLD_GLOBAL
// before libmlx, these definitions take precedence over the reference library's in symbol lookup.
// The library is tiny and has no dependency on MLX; mlx_h2o/_blas.py loads and initialises it.
#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

namespace {

using blasint64 = int64_t;  // ILP64 integer arguments
using sgemm_fn = void (*)(int, int, int, blasint64, blasint64, blasint64, float, const float*, blasint64,
                          const float*, blasint64, float, float*, blasint64);
using dgemm_fn = void (*)(int, int, int, blasint64, blasint64, blasint64, double, const double*, blasint64,
                          const double*, blasint64, double, double*, blasint64);
using cgemm_fn = void (*)(int, int, int, blasint64, blasint64, blasint64, const void*, const void*, blasint64,
                          const void*, blasint64, const void*, void*, blasint64);

sgemm_fn fast_sgemm = nullptr;
dgemm_fn fast_dgemm = nullptr;
cgemm_fn fast_cgemm = nullptr;

[[noreturn]] void uninitialised(const char* name) {
  // Unreachable through mlx_h2o._blas, which checks the symbols before loading this library.
  std::fprintf(stderr, "mlx_h2o BLAS shim: %s called before mlx_h2o_blas_init succeeded\n", name);
  std::abort();
}

}  // namespace

extern "C" {

// Returns 0 on success; non-zero leaves the shim unusable (callers must not load it globally then).
int mlx_h2o_blas_init(const char* openblas_path) {
  void* lib = dlopen(openblas_path, RTLD_NOW | RTLD_LOCAL);
  if (!lib) return 1;
  fast_sgemm = reinterpret_cast<sgemm_fn>(dlsym(lib, "scipy_cblas_sgemm64_"));
  fast_dgemm = reinterpret_cast<dgemm_fn>(dlsym(lib, "scipy_cblas_dgemm64_"));
  fast_cgemm = reinterpret_cast<cgemm_fn>(dlsym(lib, "scipy_cblas_cgemm64_"));
  return (fast_sgemm && fast_dgemm && fast_cgemm) ? 0 : 2;
}

void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, const float* a, int lda,
                 const float* b, int ldb, float beta, float* c, int ldc) {
  if (!fast_sgemm) uninitialised("cblas_sgemm");
  fast_sgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void cblas_dgemm(int order, int ta, int tb, int m, int n, int k, double alpha, const double* a, int lda,
                 const double* b, int ldb, double beta, double* c, int ldc) {
  if (!fast_dgemm) uninitialised("cblas_dgemm");
  fast_dgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void cblas_cgemm(int order, int ta, int tb, int m, int n, int k, const void* alpha, const void* a, int lda,
                 const void* b, int ldb, const void* beta, void* c, int ldc) {
  if (!fast_cgemm) uninitialised("cblas_cgemm");
  fast_cgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

}  // extern "C"
