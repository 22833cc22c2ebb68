// 8-wide float vectors (GCC/Clang vector extensions: two SSE/NEON registers or one AVX register),
// the reductions and the exp2 the CPU kernels share, and small integer helpers. Per-ISA kernel
// source: no include guard, included once per instruction set inside namespace MLX_H2O_ISA_NS (see
// isa_variants.inc). Plain C++; it uses no template defined outside the kernel sources.

namespace mlx_h2o {
namespace MLX_H2O_ISA_NS {

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef uint8_t v8u8 __attribute__((vector_size(8)));

static inline v8f splat(float x) { return v8f{x, x, x, x, x, x, x, x}; }
static inline v8f zeros8() { return splat(0.0f); }

static inline v8f load8(const float* p) {
  v8f v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}
static inline void store8(float* p, v8f v) { __builtin_memcpy(p, &v, sizeof(v)); }

template <class To, class From>
static inline To bitcast(From x) {
  static_assert(sizeof(To) == sizeof(From), "bitcast size");
  To y;
  __builtin_memcpy(&y, &x, sizeof(y));
  return y;
}

// ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7)) on AVX2: the order of the 4-row reduction in
// attention_cpu_impl.h's store_sums (hadd, hadd, lane add), so a row's sum does not depend on how many
// rows were reduced with it and a query row gets the same result in any call (chunked prefill equals
// one-shot prefill bit for bit).
static inline float hsum(v8f v) {
#if defined(MLX_H2O_ISA_AVX2)
  __m256 x = bitcast<__m256>(v);
  __m128 lo = _mm256_castps256_ps128(x), hi = _mm256_extractf128_ps(x, 1);
  lo = _mm_hadd_ps(lo, lo);
  lo = _mm_hadd_ps(lo, lo);
  hi = _mm_hadd_ps(hi, hi);
  hi = _mm_hadd_ps(hi, hi);
  return _mm_cvtss_f32(_mm_add_ss(lo, hi));
#else
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
#endif
}

static inline float hmax(v8f v) {
  float m = v[0];
  for (int i = 1; i < 8; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

static inline v8f vmax(v8f a, v8f b) { return a > b ? a : b; }

// 2^x for x <= 0 (all the kernel needs): round-to-nearest split, degree-6 polynomial on
// [-0.5, 0.5] (relative error < 2e-7), exponent by integer add; x < -126 (and -inf) gives 0.
static inline v8f exp2v(v8f x) {
  const v8f lo = splat(-127.0f);
  x = x < lo ? lo : x;
  const v8f round_magic = splat(12582912.0f);  // 1.5 * 2^23
  v8f t = x + round_magic;
  v8i xi = bitcast<v8i>(t) - bitcast<v8i>(round_magic);
  v8f f = x - (t - round_magic);
  v8f p = splat(1.5403530393381606e-4f);
  p = p * f + 1.3333558146428443e-3f;
  p = p * f + 9.6181291076284772e-3f;
  p = p * f + 5.5504108664821580e-2f;
  p = p * f + 2.4022650695910071e-1f;
  p = p * f + 6.9314718055994531e-1f;
  p = p * f + 1.0f;
  v8f r = bitcast<v8f>(bitcast<v8i>(p) + (xi << 23));
  return x < splat(-126.0f) ? zeros8() : r;
}

static inline float exp2s(float x) { return exp2v(splat(x))[0]; }

static inline int imin(int a, int b) { return a < b ? a : b; }
static inline int imax(int a, int b) { return a > b ? a : b; }
static inline int round_up8(int x) { return (x + 7) & ~7; }

}  // namespace MLX_H2O_ISA_NS
}  // namespace mlx_h2o
