// y = x @ W^T over MLX's packed affine weights with integer dot products (see int8_dot.h). Per-ISA
// kernel source: no include guard, included once per instruction set by quantized_matmul_cpu.cpp
// (isa_variants.inc).
//
// With w = s_g * q + b_g per group g and each 32-value block c of x replaced by x' = d_c * xq_c:
//   y[n] = sum_g s_g * sum_{c in g} d_c * (xq_c . q_c)  +  sum_g b_g * sum_{j in g} x'_j
// i.e. exactly x' @ W^T: the only error is x's int8 rounding (|x - x'| <= d / 2 per value) times the
// true weights. (Taking the bias term from the exact sums of x instead would leave that rounding
// multiplied by s_g * q, which for unsigned q is not centred: measured 5x the perplexity cost.) 8-bit
// weights are dotted as q - 128 (signed), their bias shifted by 128 * s_g to match.

#include "simd.h"
#include "convert.h"
#include "work.h"
#include "int8_dot.h"
#include "row_ops.h"

namespace mlx_h2o {
namespace MLX_H2O_ISA_NS {

// The rows of x of one call, quantized once.
struct QuantizedRows {
  const int8_t* q;     // [M x K]
  const float* d;      // [M x K / 32] block scales
  const float* gsum;   // [M x K / group_size] sums of x' = d * xq per weight group
  int K, blocks, groups;
};

#if defined(MLX_H2O_ISA_AVX2)
// The 4-bit blocks of a weight row two at a time (int8_dot.h, U4Pair), into the even / odd
// accumulators by pair. Each row's factors s_g * d_c are made 8 blocks at a time as one vector and
// spread onto each pair's two halves with a permute. Returns the blocks done: all but a trailing
// unpaired block, which keeps the one-block layout.
template <int RR, class SE>
static inline int add_u4_pairs(const uint8_t* wr, const typename SE::Storage* sr, int blocks, int group_shift,
                               const int8_t* const* xq, const float* const* xd, v8f* even, v8f* odd) {
  constexpr int block_bytes = QBLOCK / 2;
  const __m256i spread[4] = {_mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3),
                             _mm256_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5), _mm256_setr_epi32(6, 6, 6, 6, 7, 7, 7, 7)};
  int c = 0;
  for (; c + 8 <= blocks; c += 8) {
    v8f scale;
    if (group_shift == 0) {
      scale = SE::load8(sr + c);
    } else {
      alignas(32) float s8[8];
      for (int i = 0; i < 8; ++i) s8[i] = SE::load1(sr + ((c + i) >> group_shift));
      scale = load8(s8);
    }
    v8f f[RR];
    for (int r = 0; r < RR; ++r) f[r] = scale * load8(xd[r] + c);
    for (int k = 0; k < 4; ++k) {
      const U4Pair W = load_u4_pair(wr + (c + 2 * k) * block_bytes);
      v8f* acc = k & 1 ? odd : even;
      for (int r = 0; r < RR; ++r) {
        const v8f fk = bitcast<v8f>(_mm256_permutevar8x32_ps(bitcast<__m256>(f[r]), spread[k]));
        acc[r] += __builtin_convertvector(dot_pair(W, xq[r] + (c + 2 * k) * QBLOCK), v8f) * fk;
      }
    }
  }
  for (; c + 2 <= blocks; c += 2) {
    const U4Pair W = load_u4_pair(wr + c * block_bytes);
    const float s0 = SE::load1(sr + (c >> group_shift)), s1 = SE::load1(sr + ((c + 1) >> group_shift));
    for (int r = 0; r < RR; ++r)
      even[r] += __builtin_convertvector(dot_pair(W, xq[r] + c * QBLOCK), v8f) * pair_factors(s0 * xd[r][c], s1 * xd[r][c + 1]);
  }
  return c;
}
#endif

// Output columns [n0, n1) for the RR rows r0.. of x. Each row sums its even and its odd blocks in two
// accumulators (two chains of dependent FMAs: ~6 % faster on 8-bit weights, measured in
// docs/cpu-decode.md). The order depends on nothing but K, so a row's result is the same in any call
// (any RR, any number of rows).
template <int BITS, int RR, class SE>
static void qmm_columns(const QuantizedMatmulProblem& p, const QuantizedRows& a, int r0, int n0, int n1) {
  using PB = PackedBlocks<BITS>;
  using S = typename SE::Storage;
  constexpr int block_bytes = QBLOCK * BITS / 8;
  const int bpg = p.W.group_size / QBLOCK;
  const int group_shift = bpg == 1 ? 0 : bpg == 2 ? 1 : 2;  // group of block c: c >> group_shift
  const int64_t row_bytes = static_cast<int64_t>(p.W.K) * BITS / 8;
  const uint8_t* w = reinterpret_cast<const uint8_t*>(p.W.w);
  const S* scales = static_cast<const S*>(p.W.scales);
  const S* biases = static_cast<const S*>(p.W.biases);
  const int8_t* xq[RR];
  const float* xd[RR];
  const float* xs[RR];
  for (int r = 0; r < RR; ++r) {
    xq[r] = a.q + static_cast<int64_t>(r0 + r) * a.K;
    xd[r] = a.d + static_cast<int64_t>(r0 + r) * a.blocks;
    xs[r] = a.gsum + static_cast<int64_t>(r0 + r) * a.groups;
  }
  // Software prefetch of the row ~12 KB on: a decode step streams ~100 MB of weights from memory,
  // and with the hardware prefetcher alone the loads' latency stayed in series with the arithmetic
  // (a step's 211 products at 13 GB/s, where one core reads 30; with this, 15-16 GB/s: 1.5, 3, 6 and
  // 12 KB measured, docs/cpu-decode.md).
  const int64_t ahead = imax(2, static_cast<int>(12288 / row_bytes));
  const int64_t scale_row_bytes = static_cast<int64_t>(a.groups) * sizeof(S);
  for (int n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    const S* sr = scales + static_cast<int64_t>(n) * a.groups;
    const S* br = biases + static_cast<int64_t>(n) * a.groups;
    if (n + ahead < p.W.N) {
      const uint8_t* next = wr + ahead * row_bytes;
      for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(next + off, 0, 3);
      __builtin_prefetch(reinterpret_cast<const char*>(sr) + ahead * scale_row_bytes, 0, 3);
      __builtin_prefetch(reinterpret_cast<const char*>(br) + ahead * scale_row_bytes, 0, 3);
    }
    v8f even[RR], odd[RR];
    float bias_sum[RR];
    for (int r = 0; r < RR; ++r) even[r] = zeros8(), odd[r] = zeros8();
    // The bias term, 8 groups at a time: as one scalar chain of FMAs over the groups it took a
    // quarter of the kernel's time (1.3x faster without it, docs/cpu-decode.md).
    v8f bias_acc[RR];
    for (int r = 0; r < RR; ++r) bias_acc[r] = zeros8();
    int g = 0;
    for (; g + 8 <= a.groups; g += 8) {
      v8f b = SE::load8(br + g);
      if constexpr (PB::bias_shift != 0.0f) b += splat(PB::bias_shift) * SE::load8(sr + g);
      for (int r = 0; r < RR; ++r) bias_acc[r] += b * load8(xs[r] + g);
    }
    for (int r = 0; r < RR; ++r) bias_sum[r] = hsum(bias_acc[r]);
    for (; g < a.groups; ++g) {
      const float b = SE::load1(br + g) + PB::bias_shift * SE::load1(sr + g);
      for (int r = 0; r < RR; ++r) bias_sum[r] += b * xs[r][g];
    }
    auto add_block = [&](v8f* acc, int c) {
      const typename PB::Block W = PB::load(wr + c * block_bytes);
      const float s = SE::load1(sr + (c >> group_shift));
      for (int r = 0; r < RR; ++r)
        acc[r] += __builtin_convertvector(dot_block(W, xq[r] + c * QBLOCK), v8f) * splat(s * xd[r][c]);
    };
    int c = 0;
#if defined(MLX_H2O_ISA_AVX2)
    if constexpr (BITS == 4) c = add_u4_pairs<RR, SE>(wr, sr, a.blocks, group_shift, xq, xd, even, odd);
#endif
    for (; c + 1 < a.blocks; c += 2) add_block(even, c), add_block(odd, c + 1);
    if (c < a.blocks) add_block(even, c);
    for (int r = 0; r < RR; ++r) {
      const int64_t at = static_cast<int64_t>(r0 + r) * p.W.N + n;
      const float y = hsum(even[r] + odd[r]) + bias_sum[r];
      store_scalar(p.out, p.out_type, at,
                   p.residual ? load_scalar(p.residual, p.residual_type, at) + round_to(p.product_type, y) : y);
    }
  }
}

// f(Bits<B>, SE) with the compile-time bits (among `bits`) and scale element type of W: the one place
// the weight formats are enumerated.
template <int B>
struct Bits {
  static constexpr int value = B;
};
template <int... Bs, class F>
static void with_weight_format(const PackedWeights& W, F&& f) {
  auto by_scale = [&](auto bits) { with_float_elem(W.scale_type, [&](auto scale_elem) { f(bits, scale_elem); }); };
  ((W.bits == Bs ? by_scale(Bits<Bs>{}) : void()), ...);
}

static void run_quantized_matmul(const QuantizedMatmulProblem& p) {
  const int K = p.W.K, blocks = K / QBLOCK, groups = K / p.W.group_size;
  Scratch<int8_t> q(static_cast<int64_t>(p.M) * K);
  FloatBuffer d(static_cast<int64_t>(p.M) * blocks), gsum(static_cast<int64_t>(p.M) * groups), xf(K);
  for (int r = 0; r < p.M; ++r) {
    const int64_t base = static_cast<int64_t>(r) * K;
    if (p.swiglu) {
      with_float_elem(p.x_type, [&](auto elem) {
        using S = typename decltype(elem)::Storage;
        const S* gate = static_cast<const S*>(p.x) + 2 * base;
        swiglu_row<decltype(elem)>(gate, gate + K, K, xf.p);
      });
      for (int j = 0; j < K; ++j) xf.p[j] = round_to(p.x_type, xf.p[j]);
    } else if (p.norm) {
      rms_norm_row(p.x, p.x_type, base, K, p.norm_weight, p.norm_weight_type, 1, p.norm_eps, xf.p);
      for (int j = 0; j < K; ++j) xf.p[j] = round_to(p.norm_type, xf.p[j]);
    } else {
      for (int j = 0; j < K; ++j) xf.p[j] = load_scalar(p.x, p.x_type, base + j);
    }
    float* dr = d.p + static_cast<int64_t>(r) * blocks;
    quantize_int8_blocks(xf.p, K, p.W.bits, q.p + base, dr);
    const int bpg = p.W.group_size / QBLOCK;
    for (int g = 0; g < groups; ++g) {
      float sum = 0.0f;
      for (int c = g * bpg; c < (g + 1) * bpg; ++c) {
        int32_t block_sum = 0;
        for (int j = 0; j < QBLOCK; ++j) block_sum += q.p[base + c * QBLOCK + j];
        sum += dr[c] * static_cast<float>(block_sum);
      }
      gsum.p[static_cast<int64_t>(r) * groups + g] = sum;
    }
#if defined(MLX_H2O_ISA_AVX2)
    if (p.W.bits == 4) to_u4_pair_layout(q.p + base, K);  // after the block sums, which read whole blocks
#endif
  }
  const QuantizedRows rows{q.p, d.p, gsum.p, K, blocks, groups};
  constexpr int chunk = 32;  // output columns per task
  const int tasks = (p.W.N + chunk - 1) / chunk;
  const int64_t work = static_cast<int64_t>(p.M) * p.W.N * K;
  const int threads = work < (int64_t(1) << 17) ? 1 : p.threads;
  with_weight_format<4, 8>(p.W, [&](auto bits, auto scale_elem) {
    constexpr int BITS = decltype(bits)::value;
    using SE = decltype(scale_elem);
    auto task = [&](int t) {
      const int n0 = t * chunk, n1 = imin(p.W.N, n0 + chunk);
      for (int r0 = 0; r0 < p.M; r0 += 4) {
        switch (imin(4, p.M - r0)) {
          case 4: qmm_columns<BITS, 4, SE>(p, rows, r0, n0, n1); break;
          case 3: qmm_columns<BITS, 3, SE>(p, rows, r0, n0, n1); break;
          case 2: qmm_columns<BITS, 2, SE>(p, rows, r0, n0, n1); break;
          default: qmm_columns<BITS, 1, SE>(p, rows, r0, n0, n1); break;
        }
      }
    };
    run_parallel(tasks, threads, task);
  });
}

static void run_dequantize(const DequantizeProblem& p) {
  const PackedWeights& W = p.W;
  const int64_t out_rows = p.rows ? p.n_rows : W.N;
  constexpr int rows_per_task = 16;
  const int tasks = static_cast<int>((out_rows + rows_per_task - 1) / rows_per_task);
  const int threads = out_rows * W.K < (int64_t(1) << 16) ? 1 : p.threads;
  // The row of W that output row i holds, or -1 for an index outside W.
  auto source_row = [&](int64_t i) -> int64_t {
    if (!p.rows) return i;
    int64_t n = p.rows_unsigned ? static_cast<int64_t>(static_cast<const uint32_t*>(p.rows)[i])
                                : static_cast<int64_t>(static_cast<const int32_t*>(p.rows)[i]);
    if (n < 0) n += W.N;
    return n >= 0 && n < W.N ? n : -1;
  };
  with_weight_format<2, 3, 4, 5, 6, 8>(W, [&](auto bits, auto scale_elem) {
    constexpr int BITS = decltype(bits)::value;
    using SE = decltype(scale_elem);
    using S = typename SE::Storage;
    const int groups = W.K / W.group_size;
    const int64_t row_bytes = static_cast<int64_t>(W.K) * BITS / 8;
    auto task = [&](int t) {
      const int64_t end = (t + 1) * int64_t(rows_per_task) < out_rows ? (t + 1) * int64_t(rows_per_task) : out_rows;
      for (int64_t i = static_cast<int64_t>(t) * rows_per_task; i < end; ++i) {
        const int64_t out_row = i * W.K;
        const int64_t n = source_row(i);
        if (n < 0) {
          for (int j = 0; j < W.K; ++j) store_scalar(p.out, p.out_type, out_row + j, __builtin_nanf(""));
          continue;
        }
        const uint8_t* wr = reinterpret_cast<const uint8_t*>(W.w) + n * row_bytes;
        const S* sr = static_cast<const S*>(W.scales) + n * groups;
        const S* br = static_cast<const S*>(W.biases) + n * groups;
        for (int g = 0; g < groups; ++g) {
          const v8f s = splat(SE::load1(sr + g)), b = splat(SE::load1(br + g));
          for (int j = g * W.group_size; j < (g + 1) * W.group_size; j += 8) {
            const v8f v = unpack8<BITS>(wr + (j >> 3) * BITS) * s + b;
            if (p.out_type == ElemType::float32) {
              store8(static_cast<float*>(p.out) + out_row + j, v);
            } else {
              for (int k = 0; k < 8; ++k) store_scalar(p.out, p.out_type, out_row + j + k, v[k]);
            }
          }
        }
      }
    };
    run_parallel(tasks, threads, task);
  });
}

static void quantized_matmul_cpu_entry(const QuantizedMatmulProblem& p) { run_quantized_matmul(p); }
static void dequantize_cpu_entry(const DequantizeProblem& p) { run_dequantize(p); }

}  // namespace MLX_H2O_ISA_NS
}  // namespace mlx_h2o
