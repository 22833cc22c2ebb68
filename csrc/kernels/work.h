// Scratch memory and the thread pool as the per-ISA kernels use them: plain malloc (fresh, or kept
// per thread between calls) and a function pointer into parallel.h, so no allocator or
// std::function template is instantiated per ISA.
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

// Float scratch kept on the calling thread from one call to the next, for the buffers a call needs
// whole (an h2o prefill's attention takes a few MiB of logits a call). Allocated fresh each call,
// a buffer that large is a memory map of its own once large allocations are
// (mlx_h2o.use_mmap_for_large_buffers), and every call would fault in fresh pages: ~15 % of such a
// prefill. The buffer is given back when a call needs under an eighth of a large one (decode after a
// prefill), so a process holds it only while large calls repeat. Each Slot is one buffer: a call
// that needs two at once takes two slots.
template <int Slot>
struct KeptFloats {
  float* p = nullptr;
  explicit KeptFloats(int64_t n) {
    static thread_local Kept kept;
    const bool large = kept.n * static_cast<int64_t>(sizeof(float)) > (int64_t(1) << 20);
    if (n > kept.n || (large && n < kept.n / 8)) {
      __builtin_free(kept.p);
      kept.p = nullptr;
      kept.n = 0;
      if (n > 0) {
        kept.p = static_cast<float*>(__builtin_malloc(sizeof(float) * n));
        if (!kept.p) throw_out_of_memory();
        kept.n = n;
      }
    }
    p = kept.p;
  }
  KeptFloats(const KeptFloats&) = delete;
  KeptFloats& operator=(const KeptFloats&) = delete;

 private:
  struct Kept {
    float* p = nullptr;
    int64_t n = 0;
    ~Kept() { __builtin_free(p); }
  };
};

template <class F>
static void run_parallel(int n, int threads, F& f) {
  parallel_for(n, threads, [](void* ctx, int i) { (*static_cast<F*>(ctx))(i); }, &f);
}

}  // namespace MLX_H2O_ISA_NS
}  // namespace mlx_h2o
