// Scratch memory and the thread pool as the per-ISA kernels use them: plain malloc and a function
// pointer into parallel.h, so no allocator or std::function template is instantiated per ISA.
// Per-ISA kernel source (no include guard).

namespace mlx_h2o {
namespace MLX_H2O_ISA_NS {

struct FloatBuffer {
  float* p = nullptr;
  explicit FloatBuffer(int64_t n) : p(n > 0 ? static_cast<float*>(__builtin_malloc(sizeof(float) * n)) : nullptr) {
    if (n > 0 && !p) throw_out_of_memory();
  }
  ~FloatBuffer() { __builtin_free(p); }
  FloatBuffer(const FloatBuffer&) = delete;
  FloatBuffer& operator=(const FloatBuffer&) = delete;
};

template <class F>
static void run_parallel(int n, int threads, F& f) {
  parallel_for(n, threads, [](void* ctx, int i) { (*static_cast<F*>(ctx))(i); }, &f);
}

}  // namespace MLX_H2O_ISA_NS
}  // namespace mlx_h2o
