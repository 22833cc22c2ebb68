// The fused CPU attention kernel. No include guard: attention_cpu.cpp includes this file once per
// instruction set (isa_variants.inc), each time inside its own namespace MLX_H2O_ISA_NS and under
// that ISA's target pragma, so the variants never share a symbol. Plain C++ with GCC/Clang vector
// extensions over the shared pieces: simd.h (vectors, exp2), convert.h (f16/bf16), kv_rows.h
// (K/V row loaders), work.h (scratch, threads).
//
// Algorithm (per kv head, per block of query rows; FlashAttention-2 style on the CPU):
//   rows   = the G query heads of the kv group x a block of query positions, so each K/V row is
//            read from memory once per kv head (GQA/MQA never materialise repeated K/V);
//   tiles  = TILE keys at a time: logits S = Q K^T for the tile (K converted to float in registers),
//            mask, online softmax (running max m, sum l, rescaled accumulator), acc += P V;
//   splits = for few rows (decode), the key range is split across threads and the partial
//            (m, l, acc) are combined afterwards (flash-decoding);
//   scores = "logits" streams the masked logits to the output; "mass" keeps the tile logits in a
//            scratch of (rows x N) floats and, once every row's final (m, l) is known, adds
//            exp(S - m) / l over the rows of each kv group: post-softmax mass without a second
//            Q K^T pass. Rows are processed in waves so the scratch stays bounded for long prefills.
//            A decode block that is one task (no key splits) adds its own at the end of the task.
// Logits are kept in log2 units (q is pre-scaled by scale * log2(e)) so the softmax uses exp2.

#include "simd.h"
#include "convert.h"
#include "kv_rows.h"
#include "work.h"
#include "int8_dot.h"

namespace mlx_h2o {
namespace MLX_H2O_ISA_NS {

constexpr int TILE = 64;  // keys per tile: K and V tiles stay in L1
constexpr int MAX_SPLITS = 64;
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;
constexpr float NEG_INF = -__builtin_inff();

// ---------------------------------------------------------------------------------------------
// The work plan.
//
// A "block" is (b, kv head, a run of `block_l` query positions): rows r = li * G + g for the G query
// heads g of the group and positions l0 + li. Blocks are numbered b-major, then kv head, then
// position, and are processed in waves (consecutive blocks) so that the "mass" scratch
// (rows x N floats per block) stays under a budget. Within a wave each block's key range is cut into
// `splits` pieces for parallelism when there are few blocks (decode).

struct Plan {
  int G, block_l, blocks_per_head, n_blocks, splits, split_len, wave_blocks, threads;
  int Dkp, Dvp;  // Dk, Dv rounded up to 8
  bool int8_queries;  // some segment's keys are packed 4-/8-bit and the queries go to int8 for them
};

static Plan make_plan(const AttentionProblem& p) {
  Plan pl{};
  pl.G = p.Hq / p.Hkv;
  pl.Dkp = round_up8(p.Dk);
  pl.Dvp = round_up8(p.Dv);
  pl.int8_queries = false;
  for (int i = 0; i < p.n_segments; ++i) {
    const KVSource& k = p.segments[i].k;
    pl.int8_queries |= p.int8_queries && p.Dk % QBLOCK == 0 && k.quantized && (k.bits == 4 || k.bits == 8);
  }
  // ~32 rows per block: enough reuse of each K/V tile, small per-block state.
  pl.block_l = imax(1, imin(p.L, 32 / pl.G));
  pl.blocks_per_head = (p.L + pl.block_l - 1) / pl.block_l;
  pl.n_blocks = p.B * p.Hkv * pl.blocks_per_head;
  int64_t work = static_cast<int64_t>(p.B) * p.Hq * p.L * p.N * (p.Dk + p.Dv);
  pl.threads = work < (1 << 18) ? 1 : imax(1, p.threads);  // tiny problems: threads cost more than they save
  // Split the keys when blocks alone cannot keep the threads evenly busy (decode): ~8 tasks per
  // thread under dynamic scheduling, each split at least 4 tiles.
  int splits = 1;
  if (pl.threads > 1 && pl.n_blocks < 8 * pl.threads) {
    splits = (8 * pl.threads + pl.n_blocks - 1) / pl.n_blocks;
    splits = imax(1, imin(imin(splits, MAX_SPLITS), p.N / (4 * TILE)));
  }
  pl.split_len = ((p.N + splits - 1) / splits + TILE - 1) / TILE * TILE;
  pl.splits = (p.N + pl.split_len - 1) / pl.split_len;
  if (p.score_mode == ScoreMode::mass) {
    // 2 MiB of logits scratch per wave, and a block per thread at least. The scratch is the
    // process's for a whole prefill (KeptFloats), so it sits on the peak: 32 MiB here put 9 MiB on
    // a 512-token prompt's. More waves cost nothing measurable, and the scores' bits do not depend on
    // them: phase C adds every block's rows in block order whatever the waves.
    const int64_t budget_floats = int64_t(1) << 19;
    const int64_t fit = budget_floats / (static_cast<int64_t>(pl.G) * pl.block_l * p.N);
    pl.wave_blocks = static_cast<int>(fit > pl.n_blocks ? pl.n_blocks : imax(static_cast<int>(fit), imin(pl.threads, pl.n_blocks)));
  } else {
    pl.wave_blocks = pl.n_blocks;
  }
  return pl;
}

struct Block {
  int b, h, l0, nl;  // batch, kv head, first query position, positions in the block
};

static inline Block block_at(const AttentionProblem& p, const Plan& pl, int i) {
  Block bk;
  int pos = i % pl.blocks_per_head;
  int bh = i / pl.blocks_per_head;
  bk.b = bh / p.Hkv;
  bk.h = bh % p.Hkv;
  bk.l0 = pos * pl.block_l;
  bk.nl = imin(pl.block_l, p.L - bk.l0);
  return bk;
}

// Last key position (inclusive) that query position l may see.
static inline int key_limit(const AttentionProblem& p, int l) {
  return p.mask_kind == MaskKind::causal ? p.N - p.L + l : p.N - 1;
}

// ---------------------------------------------------------------------------------------------
// Micro-kernels on one tile of `tn` keys for RR rows (RR = 1..4, a compile-time constant so the
// accumulators stay in registers). Head dims are handled in multiples of 8 (D8); a dense head dim
// that is not a multiple of 8 adds its last columns in qk_tail / pv_tail.

// Storage traits: packed rows (any bits), and the packed keys the int8 query path handles.
template <class KV>
struct PackedRows {
  static constexpr bool value = false;
};
template <int BITS, class SE>
struct PackedRows<QuantLoader<BITS, SE>> {
  static constexpr bool value = true;
};
template <class KV>
struct Int8Keys {
  static constexpr bool value = false;
};
template <int BITS, class SE>
struct Int8Keys<QuantLoader<BITS, SE>> {
  static constexpr bool value = BITS == 4 || BITS == 8;
};

// s[j * lds] = hsum(a[j]) for j < RR.
template <int RR>
static inline void store_sums(const v8f* a, float* s, int lds) {
#if defined(MLX_H2O_ISA_AVX2)
  if constexpr (RR >= 3) {  // reduce 4 vectors at once: 3 hadds and one 128-bit add
    const __m256 z = _mm256_setzero_ps();
    const __m256 h01 = _mm256_hadd_ps(bitcast<__m256>(a[0]), bitcast<__m256>(a[1]));
    const __m256 h23 = _mm256_hadd_ps(bitcast<__m256>(a[2]), RR == 4 ? bitcast<__m256>(a[RR - 1]) : z);
    const __m256 h = _mm256_hadd_ps(h01, h23);
    const __m128 r = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    alignas(16) float out[4];
    _mm_store_ps(out, r);
    for (int j = 0; j < RR; ++j) s[j * lds] = out[j];
    return;
  }
#endif
  for (int j = 0; j < RR; ++j) s[j * lds] = hsum(a[j]);
}

template <int RR, class KV>
static inline void qk_rows(const KV& K, const float* q, int ldq, const typename KV::Row* rows, int tn, int D8, float* s, int lds) {
  for (int t = 0; t < tn; ++t) {
    const typename KV::Row& kr = rows[t];
    v8f a[RR];
    for (int j = 0; j < RR; ++j) a[j] = zeros8();
    int d = 0;
    for (; d + 32 <= D8; d += 32) {  // 32 columns lie in one quantization group
      const typename KV::Group gp = K.group(kr, d);
      for (int c = 0; c < 32; c += 8) {
        const v8f kv = K.load(kr, gp, d + c);
        for (int j = 0; j < RR; ++j) a[j] += load8(q + j * ldq + d + c) * kv;
      }
    }
    for (; d < D8; d += 8) {
      const v8f kv = K.load(kr, K.group(kr, d), d);
      for (int j = 0; j < RR; ++j) a[j] += load8(q + j * ldq + d) * kv;
    }
    store_sums<RR>(a, s + t, lds);
  }
}

// RR rows x NB chunks of 8 columns starting at d0 (inside one quantization group). Packed V:
// sum_t p_t * (s_t * raw_t + b_t) = sum_t (p_t * s_t) * raw_t + sum_t p_t * b_t, so each value costs
// one multiply-add per row and the bias one scalar per key and row.
template <int RR, int NB, class KV>
static inline void pv_block(const KV& V, const float* pr, int ldp, const typename KV::Row* rows, int tn, int d0, float* acc, int lda) {
  v8f a[RR][NB];
  for (int j = 0; j < RR; ++j)
    for (int c = 0; c < NB; ++c) a[j][c] = load8(acc + j * lda + d0 + 8 * c);
  if constexpr (PackedRows<KV>::value) {
    float bias[RR] = {};
    for (int t = 0; t < tn; ++t) {
      const float sc = V.scale_of(rows[t], d0), bi = V.bias_of(rows[t], d0);
      v8f p[RR];
      for (int j = 0; j < RR; ++j) {
        p[j] = splat(pr[j * ldp + t] * sc);
        bias[j] += pr[j * ldp + t] * bi;
      }
      for (int c = 0; c < NB; ++c) {
        const v8f raw = KV::load_raw(rows[t], d0 + 8 * c);
        for (int j = 0; j < RR; ++j) a[j][c] += p[j] * raw;
      }
    }
    for (int j = 0; j < RR; ++j)
      for (int c = 0; c < NB; ++c) a[j][c] += splat(bias[j]);
  } else {
    for (int t = 0; t < tn; ++t) {
      const typename KV::Group gp = V.group(rows[t], d0);
      v8f p[RR];
      for (int j = 0; j < RR; ++j) p[j] = splat(pr[j * ldp + t]);
      for (int c = 0; c < NB; ++c) {
        const v8f vv = V.load(rows[t], gp, d0 + 8 * c);
        for (int j = 0; j < RR; ++j) a[j][c] += p[j] * vv;
      }
    }
  }
  for (int j = 0; j < RR; ++j)
    for (int c = 0; c < NB; ++c) store8(acc + j * lda + d0 + 8 * c, a[j][c]);
}

template <int RR, class KV>
static inline void pv_rows(const KV& V, const float* pr, int ldp, const typename KV::Row* rows, int tn, int D8, float* acc, int lda) {
  // RR * NB accumulators + RR broadcasts + 1 value: at most 16 vector registers.
  constexpr int NB = RR <= 3 ? 4 : 2;
  int d = 0;
  for (; d + 8 * NB <= D8; d += 8 * NB) pv_block<RR, NB>(V, pr, ldp, rows, tn, d, acc, lda);
  for (; d < D8; d += 8) pv_block<RR, 1>(V, pr, ldp, rows, tn, d, acc, lda);
}

template <class KV>
static void qk_tail(const KV& K, const float* q, int ldq, int R, const typename KV::Row* rows, int tn, int D8, int D, float* s, int lds) {
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < tn; ++t) {
      float x = 0.0f;
      for (int d = D8; d < D; ++d) x += q[r * ldq + d] * K.load1(rows[t], d);
      s[r * lds + t] += x;
    }
}

template <class KV>
static void pv_tail(const KV& V, const float* pr, int ldp, int R, const typename KV::Row* rows, int tn, int D8, int D, float* acc, int lda) {
  for (int t = 0; t < tn; ++t)
    for (int d = D8; d < D; ++d) {
      const float vv = V.load1(rows[t], d);
      for (int r = 0; r < R; ++r) acc[r * lda + d] += pr[r * ldp + t] * vv;
    }
}

template <int N>
struct RowCount {
  static constexpr int value = N;
};

// f(RowCount<RR>{}, r) over rows [0, R) in groups of RR <= 4 rows: the row count of each call is a
// compile-time constant, so its accumulators stay in registers.
template <class F>
static inline void for_row_groups(int R, F&& f) {
  int r = 0;
  for (; r + 4 <= R; r += 4) f(RowCount<4>{}, r);
  switch (R - r) {
    case 3: f(RowCount<3>{}, r); break;
    case 2: f(RowCount<2>{}, r); break;
    case 1: f(RowCount<1>{}, r); break;
    default: break;
  }
}

// One tile of `tn` keys starting at segment-local position n0, for all R rows of a block.
template <class KV>
static void qk_tile(const KV& K, int b, int h, int n0, int tn, const float* q, int ldq, int R, int Dk, float* s, int lds) {
  typename KV::Row rows[TILE];
  K.rows(b, h, n0, tn, rows);
  const int D8 = Dk & ~7;
  for_row_groups(R, [&](auto rr, int r) { qk_rows<decltype(rr)::value>(K, q + r * ldq, ldq, rows, tn, D8, s + r * lds, lds); });
  if (D8 != Dk) qk_tail(K, q, ldq, R, rows, tn, D8, Dk, s, lds);
}

// The block's query rows rounded to int8 per 32 values (int8_dot.h), for packed 4-/8-bit keys: then
// q.k = sum_g s_g * sum_{c in g} d_c * (xq_c . kq_c) + b_g * sum_{c in g} d_c * sum(xq_c), exactly
// the rounded query times the stored key (8-bit keys dotted as kq - 128, bias shifted to match).
struct QueryInt8 {
  const int8_t* xq4;  // [R x Dk], the 4-bit weights' column order
  const int8_t* xq8;  // [R x Dk], column order
  const float* d;     // [R x Dk / 32] block scales
  const float* bsum;  // [R x Dk / 32] d * sum(xq) per block
  int Dk, blocks;
  bool ready;
};

template <int BITS, int RR, class KV>
static inline void qk_rows_int8(const KV& K, const QueryInt8& qi, int r0, const typename KV::Row* rows, int tn, float* s,
                                int lds) {
  using PB = PackedBlocks<BITS>;
  using SE = typename KV::Scale;
  constexpr int block_bytes = QBLOCK * BITS / 8;
  const int bpg = K.group_size / QBLOCK, groups = qi.Dk / K.group_size;
  const int8_t* xq[RR];
  const float* d[RR];
  const float* bs[RR];
  for (int r = 0; r < RR; ++r) {
    xq[r] = (BITS == 4 ? qi.xq4 : qi.xq8) + static_cast<int64_t>(r0 + r) * qi.Dk;
    d[r] = qi.d + static_cast<int64_t>(r0 + r) * qi.blocks;
    bs[r] = qi.bsum + static_cast<int64_t>(r0 + r) * qi.blocks;
  }
  const int blocks = qi.Dk / QBLOCK;
  for (int t = 0; t < tn; ++t) {
    const typename KV::Row& kr = rows[t];
    v8f a[RR];
    float bias[RR];
    for (int r = 0; r < RR; ++r) a[r] = zeros8(), bias[r] = 0.0f;
    for (int g = 0; g < groups; ++g) {
      const float bi = SE::load1(kr.bias + g) + PB::bias_shift * SE::load1(kr.scale + g);
      for (int c = g * bpg; c < (g + 1) * bpg; ++c)
        for (int r = 0; r < RR; ++r) bias[r] += bi * bs[r][c];
    }
    int c = 0;
#if defined(MLX_H2O_ISA_AVX2)
    if constexpr (BITS == 4) {  // two blocks per unpack (int8_dot.h, U4Pair; the queries are in the pair layout)
      for (; c + 2 <= blocks; c += 2) {
        const U4Pair W = load_u4_pair(kr.w + c * block_bytes);
        const float s0 = SE::load1(kr.scale + c / bpg), s1 = SE::load1(kr.scale + (c + 1) / bpg);
        for (int r = 0; r < RR; ++r)
          a[r] += __builtin_convertvector(dot_pair(W, xq[r] + c * QBLOCK), v8f) * pair_factors(s0 * d[r][c], s1 * d[r][c + 1]);
      }
    }
#endif
    for (; c < blocks; ++c) {
      const typename PB::Block W = PB::load(kr.w + c * block_bytes);
      const float sc = SE::load1(kr.scale + c / bpg);
      for (int r = 0; r < RR; ++r)
        a[r] += __builtin_convertvector(dot_block(W, xq[r] + c * QBLOCK), v8f) * splat(sc * d[r][c]);
    }
    store_sums<RR>(a, s + t, lds);
    for (int r = 0; r < RR; ++r) s[r * lds + t] += bias[r];
  }
}

// One tile of Q K^T: integer dots where the keys are packed 4-/8-bit and the queries were rounded,
// float dots otherwise.
template <class KV>
static void qk_tile_any(const KV& K, const QueryInt8& qi, int b, int h, int n0, int tn, const float* q, int ldq, int R,
                        int Dk, float* s, int lds) {
  if constexpr (Int8Keys<KV>::value) {
    if (qi.ready) {
      typename KV::Row rows[TILE];
      K.rows(b, h, n0, tn, rows);
      for_row_groups(R, [&](auto rr, int r) { qk_rows_int8<KV::bits, decltype(rr)::value>(K, qi, r, rows, tn, s + r * lds, lds); });
      return;
    }
  }
  qk_tile(K, b, h, n0, tn, q, ldq, R, Dk, s, lds);
}

template <class KV>
static void pv_tile(const KV& V, int b, int h, int n0, int tn, const float* pr, int ldp, int R, int Dv, float* acc, int lda) {
  typename KV::Row rows[TILE];
  V.rows(b, h, n0, tn, rows);
  const int D8 = Dv & ~7;
  for_row_groups(R, [&](auto rr, int r) { pv_rows<decltype(rr)::value>(V, pr + r * ldp, ldp, rows, tn, D8, acc + r * lda, lda); });
  if (D8 != Dv) pv_tail(V, pr, ldp, R, rows, tn, D8, Dv, acc, lda);
}


// ---------------------------------------------------------------------------------------------
// One block over one key range: partial (m, l, acc) per row, logits to `logit_rows` if given.

struct RowState {
  float* m;    // [R]
  float* l;    // [R]
  float* acc;  // [R x Dvp]
};

// Where the block's row r = li * G + g keeps its logits: the "mass" scratch (log2 units) or the
// "logits" output (natural units), whose rows for one block are not equally spaced.
struct LogitSink {
  float* base = nullptr;
  int G = 1;
  int64_t stride_l = 0, stride_g = 0;  // floats between positions li, and between heads g
  bool natural_units = false;
  float* row(int r) const { return base + (r / G) * stride_l + (r % G) * stride_g; }
};

static void attend_range(const AttentionProblem& p, const Plan& pl, const Block& bk, int n_begin, int n_end,
                         const LogitSink& sink, RowState st, float* work) {
  const int G = pl.G, R = G * bk.nl, Dkp = pl.Dkp, Dvp = pl.Dvp;
  float* q = work;                 // [R x Dkp]
  float* s = q + R * Dkp;          // [R x TILE]
  int* limit = reinterpret_cast<int*>(s + R * TILE);  // [R]
  const int qblocks = Dkp / QBLOCK;
  float* qd = s + R * TILE + R;         // [R x qblocks] int8 query scales
  float* qbsum = qd + R * qblocks;      // [R x qblocks]
  int8_t* xq4 = reinterpret_cast<int8_t*>(qbsum + R * qblocks);  // [R x Dk]
  int8_t* xq8 = xq4 + R * p.Dk;                                   // [R x Dk]

  const float qscale = p.scale * LOG2E;
  for (int li = 0; li < bk.nl; ++li) {
    for (int g = 0; g < G; ++g) {
      const int r = li * G + g, hq = bk.h * G + g, l = bk.l0 + li;
      const int64_t base = bk.b * p.q.stride[0] + hq * p.q.stride[1] + l * p.q.stride[2];
      for (int d = 0; d < p.Dk; ++d) q[r * Dkp + d] = qscale * load_scalar(p.q.data, p.q.type, base + d * p.q.stride[3]);
      for (int d = p.Dk; d < Dkp; ++d) q[r * Dkp + d] = 0.0f;
      limit[r] = key_limit(p, l);
      st.m[r] = NEG_INF;
      st.l[r] = 0.0f;
      for (int d = 0; d < Dvp; ++d) st.acc[r * Dvp + d] = 0.0f;
    }
  }
  QueryInt8 qi{xq4, xq8, qd, qbsum, p.Dk, qblocks, pl.int8_queries};
  if (qi.ready) {
    for (int r = 0; r < R; ++r) {
      float* dr = qd + r * qblocks;
      quantize_int8_blocks(q + r * Dkp, p.Dk, 4, xq4 + r * p.Dk, dr);
#if defined(MLX_H2O_ISA_AVX2)
      to_u4_pair_layout(xq4 + r * p.Dk, p.Dk);  // qk_rows_int8 takes 4-bit keys two blocks at a time
#endif
      quantize_int8_blocks(q + r * Dkp, p.Dk, 8, xq8 + r * p.Dk, dr);
      for (int c = 0; c < qblocks; ++c) {
        int32_t sum = 0;
        for (int j = 0; j < QBLOCK; ++j) sum += xq8[r * p.Dk + c * QBLOCK + j];
        qbsum[r * qblocks + c] = dr[c] * static_cast<float>(sum);
      }
    }
  }
  const int block_limit = limit[R - 1];  // rows are ordered by position: the last sees the most
  const int n_stop = imin(n_end, block_limit + 1);

  int seg = 0;
  for (int n0 = n_begin; n0 < n_stop;) {
    while (n0 >= p.segments[seg].begin + p.segments[seg].length) ++seg;
    const KVSegment& sg = p.segments[seg];
    const int tn = imin(TILE, imin(n_stop, sg.begin + sg.length) - n0);  // tiles never straddle segments
    with_loader(sg.k, [&](const auto& K) { qk_tile_any(K, qi, bk.b, bk.h, n0 - sg.begin, tn, q, Dkp, R, p.Dk, s, TILE); });

    // Masks.
    if (p.mask_kind == MaskKind::causal) {
      for (int r = 0; r < R; ++r)
        for (int t = imax(0, limit[r] + 1 - n0); t < tn; ++t) s[r * TILE + t] = NEG_INF;
    } else if (p.mask_kind == MaskKind::array) {
      const View4& mk = p.mask;
      for (int li = 0; li < bk.nl; ++li) {
        for (int g = 0; g < G; ++g) {
          const int r = li * G + g, hq = bk.h * G + g, l = bk.l0 + li;
          const int64_t base = bk.b * mk.stride[0] + hq * mk.stride[1] + l * mk.stride[2] + n0 * mk.stride[3];
          float* sr = s + r * TILE;
          if (mk.type == ElemType::boolean) {
            const uint8_t* mb = static_cast<const uint8_t*>(mk.data) + base;
            for (int t = 0; t < tn; ++t)
              if (!mb[t * mk.stride[3]]) sr[t] = NEG_INF;
          } else {
            for (int t = 0; t < tn; ++t) sr[t] += LOG2E * load_scalar(mk.data, mk.type, base + t * mk.stride[3]);
          }
        }
      }
    }
    if (sink.base) {
      for (int r = 0; r < R; ++r) {
        float* dst = sink.row(r) + n0;
        const float* sr = s + r * TILE;
        if (sink.natural_units)
          for (int t = 0; t < tn; ++t) dst[t] = sr[t] * LN2;
        else
          for (int t = 0; t < tn; ++t) dst[t] = sr[t];
      }
    }

    // Online softmax: s becomes P = exp2(s - m_new); rescale the running sum and accumulator.
    // The tile is padded with masked keys to whole vectors, so a row's sum is added up in the same
    // order wherever the tile ends (a query row gets the same result whatever N and L its call has:
    // chunked prefill equals one-shot prefill bit for bit).
    const int tn8 = round_up8(tn);
    for (int r = 0; r < R; ++r) {
      float* sr = s + r * TILE;
      for (int t = tn; t < tn8; ++t) sr[t] = NEG_INF;
      v8f mv = splat(st.m[r]);
      for (int t = 0; t < tn8; t += 8) mv = vmax(mv, load8(sr + t));
      const float m_new = hmax(mv);
      if (m_new == NEG_INF) {  // every key so far is masked for this row
        for (int t = 0; t < tn; ++t) sr[t] = 0.0f;
        continue;
      }
      const v8f mn = splat(m_new);
      v8f sum = zeros8();
      for (int t = 0; t < tn8; t += 8) {
        v8f e = exp2v(load8(sr + t) - mn);
        store8(sr + t, e);
        sum += e;
      }
      const float total = hsum(sum);
      if (m_new != st.m[r]) {
        const float alpha = exp2s(st.m[r] - m_new);
        st.l[r] *= alpha;
        float* a = st.acc + r * Dvp;
        const v8f av = splat(alpha);
        for (int d = 0; d < Dvp; d += 8) store8(a + d, load8(a + d) * av);
        st.m[r] = m_new;
      }
      st.l[r] += total;
    }
    with_loader(sg.v, [&](const auto& V) { pv_tile(V, bk.b, bk.h, n0 - sg.begin, tn, s, TILE, R, p.Dv, st.acc, Dvp); });
    n0 += tn;
  }
  // "logits" output: keys past the block's causal limit were never computed.
  if (sink.base && sink.natural_units && n_end > n_stop) {
    for (int r = 0; r < R; ++r) {
      float* dst = sink.row(r);
      for (int n = n_stop; n < n_end; ++n) dst[n] = NEG_INF;
    }
  }
}

static inline int64_t attend_work_floats(const Plan& pl, int R) {
  const int64_t int8_floats = pl.int8_queries ? 2 * static_cast<int64_t>(R) * (pl.Dkp / QBLOCK) + (2 * R * pl.Dkp + 3) / 4 : 0;
  return static_cast<int64_t>(R) * pl.Dkp + static_cast<int64_t>(R) * TILE + R + int8_floats;  // q, s, limits, int8 q
}

// Combine the split partials of one block (split sp: m at parts + sp * part_stride, then l, then
// acc), add the sink, write the output rows, and keep each row's final (m, l) for the mass pass.
static void finish_block(const AttentionProblem& p, const Plan& pl, const Block& bk, const float* parts,
                         int64_t part_stride, int nsplit, float* final_m, float* final_l) {
  const int G = pl.G, R = G * bk.nl, Dvp = pl.Dvp;
  float w[MAX_SPLITS];
  for (int r = 0; r < R; ++r) {
    const int hq = bk.h * G + r % G, l = bk.l0 + r / G;
    float m = NEG_INF;
    for (int sp = 0; sp < nsplit; ++sp) m = parts[sp * part_stride + r] > m ? parts[sp * part_stride + r] : m;
    float sink_logit = NEG_INF;
    if (p.sinks) {
      sink_logit = LOG2E * load_scalar(p.sinks, p.sinks_type, hq * p.sinks_stride);
      m = sink_logit > m ? sink_logit : m;
    }
    const int64_t out_base = ((static_cast<int64_t>(bk.b) * p.Hq + hq) * p.L + l) * p.Dv;
    if (m == NEG_INF) {  // every key masked and no sink: zero output, no mass
      for (int d = 0; d < p.Dv; ++d) store_scalar(p.out, p.out_type, out_base + d, 0.0f);
      final_m[r] = NEG_INF;
      final_l[r] = 0.0f;
      continue;
    }
    float lsum = p.sinks ? exp2s(sink_logit - m) : 0.0f;
    for (int sp = 0; sp < nsplit; ++sp) {
      w[sp] = exp2s(parts[sp * part_stride + r] - m);
      lsum += parts[sp * part_stride + R + r] * w[sp];
    }
    const float inv = 1.0f / lsum;
    for (int d = 0; d < p.Dv; ++d) {
      float a = 0.0f;
      for (int sp = 0; sp < nsplit; ++sp) a += parts[sp * part_stride + 2 * R + r * Dvp + d] * w[sp];
      store_scalar(p.out, p.out_type, out_base + d, a * inv);
    }
    final_m[r] = m;
    final_l[r] = lsum;
  }
}

// mass[b, h, n] += exp2(S - m) / l over the block's rows for keys [n0, n1) (each row up to its causal
// limit): its logits `rows` (as attend_range kept them), final m and l (finish_block).
static void add_block_mass(const AttentionProblem& p, const Plan& pl, const Block& bk, const float* rows, const float* fm,
                           const float* fl, int n0, int n1) {
  const int G = pl.G, R = G * bk.nl;
  float* out = p.scores + (static_cast<int64_t>(bk.b) * p.Hkv + bk.h) * p.N;
  for (int r = 0; r < R; ++r) {
    if (!(fl[r] > 0.0f)) continue;
    const int stop = imin(n1, key_limit(p, bk.l0 + r / G) + 1);
    const v8f mv = splat(fm[r]), inv = splat(1.0f / fl[r]);
    const float* sr = rows + static_cast<int64_t>(r) * p.N;
    int n = n0;
    for (; n + 8 <= stop; n += 8) store8(out + n, load8(out + n) + exp2v(load8(sr + n) - mv) * inv);
    for (; n < stop; ++n) out[n] += exp2s(sr[n] - fm[r]) / fl[r];
  }
}

// ---------------------------------------------------------------------------------------------
// The driver.

static void run_attention(const AttentionProblem& p) {
  const Plan pl = make_plan(p);
  const int G = pl.G, Rmax = G * pl.block_l, S = pl.splits;
  const bool mass = p.score_mode == ScoreMode::mass;
  const bool logits = p.score_mode == ScoreMode::logits;
  if (mass)
    for (int64_t i = 0, n = static_cast<int64_t>(p.B) * p.Hkv * p.N; i < n; ++i) p.scores[i] = 0.0f;

  const int64_t wave_rows = static_cast<int64_t>(pl.wave_blocks) * Rmax;
  // Kept between calls: a prefill's layers ask for the same sizes chunk after chunk.
  KeptFloats<0> logit_scratch(mass ? wave_rows * p.N : 0);
  // Partials per (block in wave, split): m[R], l[R], acc[R x Dvp].
  const int64_t part_stride = static_cast<int64_t>(Rmax) * (2 + pl.Dvp);
  KeptFloats<1> partials(static_cast<int64_t>(pl.wave_blocks) * S * part_stride);
  KeptFloats<2> finals(2 * wave_rows);  // final m, l per row of the wave
  const int64_t work_floats = attend_work_floats(pl, Rmax);
  // A block that is one task (no key splits) and alone on its kv head (decode: one query row per
  // head) owns its mass row: phase A finishes it, and there is nothing left for phases B and C.
  const bool finished_in_a = mass && S == 1 && pl.blocks_per_head == 1;

  for (int w0 = 0; w0 < pl.n_blocks; w0 += pl.wave_blocks) {
    const int nb = imin(pl.wave_blocks, pl.n_blocks - w0);

    // Phase A: every (block, split) of the wave.
    auto phase_a = [&](int task) {
      const int bi = task / S, sp = task % S;
      const Block bk = block_at(p, pl, w0 + bi);
      const int R = G * bk.nl;
      float* part = partials.p + (static_cast<int64_t>(bi) * S + sp) * part_stride;
      LogitSink sink;
      sink.G = G;
      if (mass) {
        sink.base = logit_scratch.p + static_cast<int64_t>(bi) * Rmax * p.N;
        sink.stride_l = static_cast<int64_t>(G) * p.N;
        sink.stride_g = p.N;
      } else if (logits) {
        sink.base = p.scores + ((static_cast<int64_t>(bk.b) * p.Hq + bk.h * G) * p.L + bk.l0) * p.N;
        sink.stride_l = p.N;
        sink.stride_g = static_cast<int64_t>(p.L) * p.N;
        sink.natural_units = true;
      }
      FloatBuffer scratch(work_floats);
      const int n_begin = sp * pl.split_len, n_end = imin(p.N, n_begin + pl.split_len);
      attend_range(p, pl, bk, n_begin, n_end, sink, RowState{part, part + R, part + 2 * R}, scratch.p);
      if (finished_in_a) {  // the block's phases B and C, while its logits are in this core's cache
        float* fm = finals.p + static_cast<int64_t>(bi) * Rmax;
        finish_block(p, pl, bk, part, part_stride, 1, fm, fm + wave_rows);
        add_block_mass(p, pl, bk, sink.base, fm, fm + wave_rows, 0, p.N);
      }
    };
    run_parallel(nb * S, pl.threads, phase_a);
    if (finished_in_a) continue;

    // Phase B: combine splits, write outputs, keep each row's final (m, l).
    auto phase_b = [&](int bi) {
      float* fm = finals.p + static_cast<int64_t>(bi) * Rmax;
      finish_block(p, pl, block_at(p, pl, w0 + bi), partials.p + static_cast<int64_t>(bi) * S * part_stride,
                   part_stride, S, fm, fm + wave_rows);
    };
    // Combining is cheap next to phase A: threads only when there is a lot of it.
    const int64_t b_work = static_cast<int64_t>(nb) * Rmax * S * pl.Dvp;
    run_parallel(nb, b_work > (1 << 16) ? pl.threads : 1, phase_b);

    if (!mass) continue;
    // Phase C: mass[b, h, n] += sum over the wave's rows of (b, h) of exp2(S - m) / l.
    // Key chunks small enough that a wave of one kv head's blocks still has a task per thread.
    const int chunk = imax(TILE, imin(1024, (p.N + 4 * pl.threads - 1) / (4 * pl.threads) / TILE * TILE));
    const int n_chunks = (p.N + chunk - 1) / chunk;
    const int bh_first = w0 / pl.blocks_per_head;
    const int bh_last = (w0 + nb - 1) / pl.blocks_per_head;
    const int n_bh = bh_last - bh_first + 1;
    auto phase_c = [&](int task) {
      const int bh = bh_first + task / n_chunks, c = task % n_chunks;
      const int n0 = c * chunk, n1 = imin(p.N, n0 + chunk);
      const int bi0 = imax(w0, bh * pl.blocks_per_head) - w0;
      const int bi1 = imin(w0 + nb, (bh + 1) * pl.blocks_per_head) - w0;
      for (int bi = bi0; bi < bi1; ++bi) {
        const float* fm = finals.p + static_cast<int64_t>(bi) * Rmax;
        add_block_mass(p, pl, block_at(p, pl, w0 + bi), logit_scratch.p + static_cast<int64_t>(bi) * Rmax * p.N, fm,
                       fm + wave_rows, n0, n1);
      }
    };
    const int64_t c_work = static_cast<int64_t>(nb) * Rmax * p.N;
    run_parallel(n_bh * n_chunks, c_work > (1 << 15) ? pl.threads : 1, phase_c);
  }
}

static void attention_cpu_entry(const AttentionProblem& p) { run_attention(p); }

}  // namespace MLX_H2O_ISA_NS
}  // namespace mlx_h2o
