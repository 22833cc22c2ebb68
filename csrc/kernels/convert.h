// Element conversions for the CPU kernels: float16 / bfloat16 <-> float (one or 8 at a time),
// uint8 -> float, typed scalar loads / stores, and the Elem adapters (F32Elem, F16Elem, BF16Elem)
// that loaders are templated on. Per-ISA kernel source like simd.h (no include guard).

namespace mlx_h2o {
namespace MLX_H2O_ISA_NS {

static inline float half_to_float(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t em = h & 0x7fffu;
  uint32_t bits;
  if (em >= 0x7c00u) {
    bits = 0x7f800000u | ((em & 0x3ffu) << 13);  // inf / nan
  } else if (em >= 0x400u) {
    bits = (em << 13) + ((127u - 15u) << 23);
  } else {  // zero or subnormal: em * 2^-24 is exact in float
    return bitcast<float>(sign) + (sign ? -1.0f : 1.0f) * static_cast<float>(em) * 5.9604644775390625e-8f;
  }
  return bitcast<float>(bits | sign);
}

static inline float bf16_to_float(uint16_t h) { return bitcast<float>(static_cast<uint32_t>(h) << 16); }

static inline uint16_t float_to_half(float f) {
  // Round to nearest even, with overflow to inf and gradual underflow (as numpy / MLX do).
  uint32_t x = bitcast<uint32_t>(f);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return static_cast<uint16_t>(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u));
  if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65520: inf
  if (ax < 0x38800000u) {  // below the smallest normal half: subnormal or zero
    float a = bitcast<float>(ax) * 16777216.0f;  // scale by 2^24: the subnormal's integer value
    // nearbyint with ties-to-even for the integer part
    float r = a + 8388608.0f - 8388608.0f;
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(r));
  }
  uint32_t mant_odd = (ax >> 13) & 1u;
  ax += 0xc8000fffu + mant_odd;  // rebias exponent (-112 << 23) and round
  return static_cast<uint16_t>(sign | (ax >> 13));
}

static inline uint16_t float_to_bf16(float f) {
  uint32_t x = bitcast<uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // quiet nan
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

static inline float load_scalar(const void* p, ElemType t, int64_t i) {
  switch (t) {
    case ElemType::float32:
      return static_cast<const float*>(p)[i];
    case ElemType::float16:
      return half_to_float(static_cast<const uint16_t*>(p)[i]);
    case ElemType::bfloat16:
      return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    case ElemType::boolean:
      return static_cast<const uint8_t*>(p)[i] ? 1.0f : 0.0f;
  }
  return 0.0f;
}

static inline void store_scalar(void* p, ElemType t, int64_t i, float x) {
  switch (t) {
    case ElemType::float32:
      static_cast<float*>(p)[i] = x;
      break;
    case ElemType::float16:
      static_cast<uint16_t*>(p)[i] = float_to_half(x);
      break;
    case ElemType::bfloat16:
      static_cast<uint16_t*>(p)[i] = float_to_bf16(x);
      break;
    case ElemType::boolean:
      static_cast<uint8_t*>(p)[i] = x != 0.0f;
      break;
  }
}

// x rounded to t's precision and back: what storing x as t and loading it gives.
static inline float round_to(ElemType t, float x) {
  switch (t) {
    case ElemType::float16:
      return half_to_float(float_to_half(x));
    case ElemType::bfloat16:
      return bf16_to_float(float_to_bf16(x));
    default:
      return x;
  }
}

static inline v8f half8_to_float(const uint16_t* p) {
#if defined(MLX_H2O_ISA_AVX2)
  return bitcast<v8f>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  // Branch-free half -> float (normals, subnormals, inf/nan), after F. Giesen.
  v8u16 raw;
  __builtin_memcpy(&raw, p, sizeof(raw));
  v8u h = __builtin_convertvector(raw, v8u);
  const v8u shifted_exp = v8u{} + (0x7c00u << 13);
  v8u o = (h & 0x7fffu) << 13;
  v8u e = shifted_exp & o;
  o += (127u - 15u) << 23;
  o += bitcast<v8u>(e == shifted_exp) & ((128u - 16u) << 23);
  v8u sub = bitcast<v8u>(e == 0u);
  v8f denorm = bitcast<v8f>(o + (1u << 23)) - bitcast<v8f>(v8u{} + (113u << 23));
  o = (sub & bitcast<v8u>(denorm)) | (~sub & o);
  return bitcast<v8f>(o | ((h & 0x8000u) << 16));
#endif
}

static inline v8f bf16x8_to_float(const uint16_t* p) {
  v8u16 raw;
  __builtin_memcpy(&raw, p, sizeof(raw));
  return bitcast<v8f>(__builtin_convertvector(raw, v8u) << 16);
}

static inline v8f u8x8_to_float(const uint8_t* p) {
#if defined(MLX_H2O_ISA_AVX2)
  const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return bitcast<v8f>(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(raw)));
#else
  v8u8 raw;
  __builtin_memcpy(&raw, p, sizeof(raw));
  return __builtin_convertvector(__builtin_convertvector(raw, v8i), v8f);
#endif
}

// 8 consecutive BITS-bit values of MLX's packed little-endian bit stream occupy exactly BITS bytes
// (any 8-aligned chunk is one small load), as floats.
template <int BITS>
static inline v8f unpack8(const uint8_t* p) {
  if constexpr (BITS == 8) {
    return u8x8_to_float(p);
  } else if constexpr (BITS == 4 || BITS == 2) {
    uint32_t word = 0;
    __builtin_memcpy(&word, p, BITS);
    const v8u shifts = {0u, BITS, 2u * BITS, 3u * BITS, 4u * BITS, 5u * BITS, 6u * BITS, 7u * BITS};
    return __builtin_convertvector(bitcast<v8i>((v8u{} + word) >> shifts & ((1u << BITS) - 1u)), v8f);
  } else {  // 3, 5, 6 bits: two 32-bit halves of the BITS-byte chunk
    uint64_t bitsv = 0;
    __builtin_memcpy(&bitsv, p, BITS);
    const uint32_t lo = static_cast<uint32_t>(bitsv);
    const uint32_t hi = static_cast<uint32_t>(bitsv >> (4 * BITS));
    const v8u shifts = {0u, BITS, 2u * BITS, 3u * BITS, 0u, BITS, 2u * BITS, 3u * BITS};
    return __builtin_convertvector(bitcast<v8i>((v8u{lo, lo, lo, lo, hi, hi, hi, hi} >> shifts) & ((1u << BITS) - 1u)), v8f);
  }
}

static inline float half_to_float_fast(uint16_t h) {
#if defined(MLX_H2O_ISA_AVX2)
  return _cvtsh_ss(h);
#else
  return half_to_float(h);
#endif
}

struct F32Elem {
  using Storage = float;
  static v8f load8(const float* p) { return MLX_H2O_ISA_NS::load8(p); }
  static float load1(const float* p) { return *p; }
};
struct F16Elem {
  using Storage = uint16_t;
  static v8f load8(const uint16_t* p) { return half8_to_float(p); }
  static float load1(const uint16_t* p) { return half_to_float_fast(*p); }
};
struct BF16Elem {
  using Storage = uint16_t;
  static v8f load8(const uint16_t* p) { return bf16x8_to_float(p); }
  static float load1(const uint16_t* p) { return bf16_to_float(*p); }
};

// f(E{}) with the element type (F32Elem, F16Elem, BF16Elem) of a float ElemType: the one place the
// kernels enumerate float formats. Any other type runs nothing: the ops reject it before a kernel runs.
template <class F>
static void with_float_elem(ElemType type, F&& f) {
  switch (type) {
    case ElemType::float32: f(F32Elem{}); return;
    case ElemType::float16: f(F16Elem{}); return;
    case ElemType::bfloat16: f(BF16Elem{}); return;
    default: return;
  }
}

}  // namespace MLX_H2O_ISA_NS
}  // namespace mlx_h2o
