// Integer dot products of int8 activations with packed 4-bit / 8-bit weights (llama.cpp's technique):
// a row of activations is quantized once to int8 in blocks of 32 values (one float scale per block),
// then each 32-value block of weights is unpacked once and dotted with the int8 block in integer
// arithmetic (AVX2: maddubs + madd; AVX512-VNNI: vpdpbusd, the same sums in one instruction;
// portable: plain integer loops), giving 8 partial int32 sums.
// Per-ISA kernel source (no include guard); needs simd.h.
//
// Layout of a quantized activation block (32 int8): for 4-bit weights the even columns first, then
// the odd ones, because a byte of packed 4-bit weights holds columns 2k (low nibble) and 2k + 1 (high
// nibble) and unpacking puts all low nibbles before all high ones; for 8-bit weights column order.

namespace mlx_h2o {
namespace MLX_H2O_ISA_NS {

constexpr int QBLOCK = 32;  // activation values per int8 block

/** Quantizes K floats (K a multiple of 32) to int8 blocks: xq (K), d (K / 32) block scales, in the
 *  layout for `bits`-bit weights. x * (1 / d) is rounded to nearest (|xq| <= 127). */
static inline void quantize_int8_blocks(const float* x, int K, int bits, int8_t* xq, float* d) {
  for (int b = 0; b < K / QBLOCK; ++b) {
    const float* xb = x + b * QBLOCK;
    v8f amax = zeros8();
    for (int i = 0; i < QBLOCK; i += 8) {
      const v8f v = load8(xb + i);
      amax = vmax(amax, vmax(v, -v));
    }
    const float m = hmax(amax);
    d[b] = m / 127.0f;
    const v8f inv = splat(m > 0.0f ? 127.0f / m : 0.0f);
    const v8f magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to nearest even
    int8_t* qb = xq + b * QBLOCK;
    alignas(32) int32_t r[QBLOCK];
    for (int i = 0; i < QBLOCK; i += 8) {
      const v8f t = (load8(xb + i) * inv + magic) - magic;
      const v8i iv = __builtin_convertvector(t, v8i);
      __builtin_memcpy(r + i, &iv, sizeof(iv));
    }
    if (bits == 4) {
      for (int k = 0; k < QBLOCK / 2; ++k) {
        qb[k] = static_cast<int8_t>(r[2 * k]);
        qb[QBLOCK / 2 + k] = static_cast<int8_t>(r[2 * k + 1]);
      }
    } else {
      for (int i = 0; i < QBLOCK; ++i) qb[i] = static_cast<int8_t>(r[i]);
    }
  }
}

#if defined(MLX_H2O_ISA_AVX2)

/** 32 unsigned 4-bit weights of one block (16 packed bytes), low nibbles then high nibbles. */
struct U4Block {
  __m256i w;
};
static inline U4Block load_u4_block(const uint8_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
  return {_mm256_and_si256(both, _mm256_set1_epi8(0x0f))};
}
static inline v8i dot_block(const U4Block& b, const int8_t* xq) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
#if defined(MLX_H2O_ISA_VNNI)
  return bitcast<v8i>(_mm256_dpbusd_epi32(_mm256_setzero_si256(), b.w, x));
#else
  const __m256i pairs = _mm256_maddubs_epi16(b.w, x);  // |15 * 127 * 2| fits int16
  return bitcast<v8i>(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

/** Two consecutive 4-bit blocks c, c + 1 (32 packed bytes) unpacked with one 256-bit load: `lo` holds
 *  both blocks' low nibbles (even columns), `hi` their high nibbles. Against activations in the pair
 *  layout (to_u4_pair_layout) the two blocks cost one unpack, two maddubs and one madd, where one
 *  block at a time costs a 128-bit load, an insert, two maddubs and two madds per 32 columns less. */
struct U4Pair {
  __m256i lo, hi;
};
static inline U4Pair load_u4_pair(const uint8_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i nibble = _mm256_set1_epi8(0x0f);
  return {_mm256_and_si256(raw, nibble), _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble)};
}
/** Per lane of dot_pair's sums, the factor of its block: f0 for block c's lanes (0-3), f1 for block
 *  c + 1's (4-7). */
static inline v8f pair_factors(float f0, float f1) {
  return bitcast<v8f>(_mm256_set_m128(_mm_set1_ps(f1), _mm_set1_ps(f0)));
}
/** 8 int32 partial sums of the pair against 64 activations in the pair layout: lanes 0-3 are block
 *  c's, lanes 4-7 block c + 1's. Each int16 sum of the two maddubs adds four products of at most
 *  15 * 127: no saturation. */
static inline v8i dot_pair(const U4Pair& b, const int8_t* xq) {
  const __m256i xl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
  const __m256i xh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + QBLOCK));
#if defined(MLX_H2O_ISA_VNNI)
  // Each int32 lane adds the same eight products in one instruction per half (no int16 step).
  return bitcast<v8i>(_mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), b.lo, xl), b.hi, xh));
#else
  const __m256i sums = _mm256_add_epi16(_mm256_maddubs_epi16(b.lo, xl), _mm256_maddubs_epi16(b.hi, xh));
  return bitcast<v8i>(_mm256_madd_epi16(sums, _mm256_set1_epi16(1)));
#endif
}
/** Activations quantized for 4-bit weights (each block: even columns, then odd) into the pair
 *  layout: per pair of blocks, both blocks' even columns, then both blocks' odd ones. A trailing
 *  unpaired block keeps its layout. */
static inline void to_u4_pair_layout(int8_t* xq, int K) {
  constexpr int half = QBLOCK / 2;
  for (int c = 0; c + 2 <= K / QBLOCK; c += 2) {
    int8_t* b = xq + c * QBLOCK;
    int8_t t[half];
    __builtin_memcpy(t, b + half, half);             // block c's odd columns
    __builtin_memcpy(b + half, b + QBLOCK, half);     // block c + 1's even columns
    __builtin_memcpy(b + QBLOCK, t, half);
  }
}

/** 32 8-bit weights as q - 128 (signed), and their magnitudes: maddubs multiplies unsigned by
 *  signed, so the sign moves onto the activations (|128 * 127 * 2| fits int16). */
struct S8Block {
  __m256i w, abs_w;
};
static inline S8Block load_s8_block(const uint8_t* p) {
  const __m256i w = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), _mm256_set1_epi8(-128));
  return {w, _mm256_abs_epi8(w)};
}
static inline v8i dot_block(const S8Block& b, const int8_t* xq) {
  const __m256i x = _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq)), b.w);
#if defined(MLX_H2O_ISA_VNNI)
  return bitcast<v8i>(_mm256_dpbusd_epi32(_mm256_setzero_si256(), b.abs_w, x));
#else
  const __m256i pairs = _mm256_maddubs_epi16(b.abs_w, x);
  return bitcast<v8i>(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

#else

struct U4Block {
  uint8_t w[QBLOCK];
};
static inline U4Block load_u4_block(const uint8_t* p) {
  U4Block b;
  for (int k = 0; k < QBLOCK / 2; ++k) {
    b.w[k] = p[k] & 0x0f;
    b.w[QBLOCK / 2 + k] = p[k] >> 4;
  }
  return b;
}
struct S8Block {
  int8_t w[QBLOCK];
};
static inline S8Block load_s8_block(const uint8_t* p) {
  S8Block b;
  for (int i = 0; i < QBLOCK; ++i) b.w[i] = static_cast<int8_t>(p[i] - 128);
  return b;
}
// Either block: 8 partial sums of w . xq.
template <class Block>
static inline v8i dot_block(const Block& b, const int8_t* xq) {
  v8i s = {};
  for (int i = 0; i < QBLOCK; i += 8)
    for (int j = 0; j < 8; ++j) s[j] += static_cast<int32_t>(b.w[i + j]) * xq[i + j];
  return s;
}

#endif

/** The block type of `bits`-bit weights (4: unsigned values; 8: values - 128), its loader, and the
 *  offset the 8-bit shift adds to each group's bias (bias + 128 * scale). */
template <int BITS>
struct PackedBlocks;
template <>
struct PackedBlocks<4> {
  using Block = U4Block;
  static constexpr float bias_shift = 0.0f;
  static Block load(const uint8_t* p) { return load_u4_block(p); }
};
template <>
struct PackedBlocks<8> {
  using Block = S8Block;
  static constexpr float bias_shift = 128.0f;
  static Block load(const uint8_t* p) { return load_s8_block(p); }
};

}  // namespace MLX_H2O_ISA_NS
}  // namespace mlx_h2o
