// Scratch memory and the thread pool as the per-ISA kernels use them: plain malloc and a function
// pointer into parallel.h, so no allocator or std::function template is instantiated per ISA.
// Per-ISA kernel source (no include guard).

namespace mlx_h2o {
namespace MLX_H2O_ISA_NS {

template <class T>
struct Scratch {
  T* p = nullptr;
  explicit Scratch(int64_t n) : p(n > 0 ? static_cast<T*>(__builtin_malloc(sizeof(T) * n)) : nullptr) {
    if (n > 0 && !p) throw_out_of_memory();
  }
  ~Scratch() { __builtin_free(p); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
};
using FloatBuffer = Scratch<float>;

template <class F>
static void run_parallel(int n, int threads, F& f) {
  parallel_for(n, threads, [](void* ctx, int i) { (*static_cast<F*>(ctx))(i); }, &f);
}

}  // namespace MLX_H2O_ISA_NS
}  // namespace mlx_h2o
