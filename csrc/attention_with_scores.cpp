#include "attention_with_scores.h"

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <sstream>
#include <stdexcept>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

#include "accumulate_prefix.h"
#include "kv_rows.h"
#include "op_utils.h"
#include "parallel.h"

namespace mlx_h2o {

namespace {

View4 view_of(const mx::array& a) {
  View4 v;
  v.data = a.data<void>();
  v.type = a.dtype() == mx::uint32 ? ElemType::float32 : elem_type(a.dtype());  // packed words: type unused
  const int nd = static_cast<int>(a.ndim());
  for (int i = 0; i < 4; ++i) v.stride[i] = i < nd ? a.strides()[i] : 0;
  return v;
}

// The logical shape (B, H, n, D) of one K or V input, after checking it.
struct KVShape {
  int B, H, n, D;
};

KVShape leading_rows(KVShape shape, int rows, const std::string& where) {
  if (rows < -1 || rows > shape.n)
    fail(where + ": rows must be -1 (all) or between 0 and the arrays' " + std::to_string(shape.n) + ", got " +
         std::to_string(rows));
  if (rows >= 0) shape.n = rows;
  return shape;
}

KVShape check_kv(const KVInput& in, const char* name, int segment) {
  const std::string where = std::string(name) + " of segment " + std::to_string(segment);
  if (!in.quantized()) {
    if (in.arrays.size() != 1) fail(where + " must be one array or a (packed, scales, biases) triple");
    const auto& a = in.arrays[0];
    if (a.ndim() != 4) fail(where + " must have 4 dimensions (B, Hkv, N, D), got shape " + shape_str(a.shape()));
    if (!is_float_dtype(a.dtype())) fail(where + ": dtype must be float32, float16 or bfloat16");
    return leading_rows({a.shape(0), a.shape(1), a.shape(2), a.shape(3)}, in.rows, where);
  }
  const auto &w = in.arrays[0], &sc = in.arrays[1], &bi = in.arrays[2];
  if (in.bits != 2 && in.bits != 3 && in.bits != 4 && in.bits != 5 && in.bits != 6 && in.bits != 8)
    fail("bits must be one of 2, 3, 4, 5, 6, 8, got " + std::to_string(in.bits) + " (" + where + ")");
  if (in.group_size != 32 && in.group_size != 64 && in.group_size != 128)
    fail("group_size must be one of 32, 64, 128, got " + std::to_string(in.group_size) + " (" + where + ")");
  if (w.ndim() != 4 || sc.ndim() != 4 || bi.ndim() != 4)
    fail(where + ": packed, scales and biases must have 4 dimensions (B, Hkv, N, ...)");
  if (w.dtype() != mx::uint32) fail(where + ": packed weights must be uint32 (as mx.quantize returns them)");
  if (!is_float_dtype(sc.dtype()) || sc.dtype() != bi.dtype())
    fail(where + ": scales and biases must share one dtype among float32, float16, bfloat16");
  if (sc.shape() != bi.shape()) fail(where + ": scales and biases must have the same shape");
  for (int i = 0; i < 3; ++i)
    if (w.shape(i) != sc.shape(i))
      fail(where + ": packed " + shape_str(w.shape()) + " and scales " + shape_str(sc.shape()) + " disagree on (B, Hkv, N)");
  const int64_t bits_total = static_cast<int64_t>(w.shape(3)) * 32;
  if (bits_total % in.bits) fail(where + ": packed width does not hold whole " + std::to_string(in.bits) + "-bit values");
  const int D = static_cast<int>(bits_total / in.bits);
  if (D % in.group_size || sc.shape(3) != D / in.group_size)
    fail(where + ": " + std::to_string(D) + " values per row need " + std::to_string(D / in.group_size) +
         " scales for group_size " + std::to_string(in.group_size) + ", got " + std::to_string(sc.shape(3)) +
         " (do bits and group_size match the ones used to quantize?)");
  return leading_rows({w.shape(0), w.shape(1), w.shape(2), D}, in.rows, where);
}

// The rows a K or V input reads: its `rows`, or all of its arrays'.
int rows_read(const KVInput& in) { return in.rows >= 0 ? in.rows : in.arrays[0].shape(2); }

// The first `rows` rows of a (B, H, n, ...) array (all of them for -1).
mx::array leading(const mx::array& a, int rows, mx::StreamOrDevice s) {
  if (rows < 0 || rows == a.shape(2)) return a;
  mx::Shape stop = a.shape();
  stop[2] = rows;
  return mx::slice(a, mx::Shape(a.ndim(), 0), std::move(stop), s);
}

ScoreMode parse_scores(const std::string& scores) {
  if (scores == "mass") return ScoreMode::mass;
  if (scores == "logits") return ScoreMode::logits;
  if (scores.empty() || scores == "none") return ScoreMode::none;
  fail("scores must be one of 'mass', 'logits' or None, got '" + scores + "'");
}

struct Checked {
  int B, Hq, Hkv, L, N, Dk, Dv;
  MaskKind mask_kind;
  ScoreMode score_mode;
  std::vector<SegmentInput> segments;  // the non-empty ones
};

Checked check_args(const mx::array& q, const std::vector<SegmentInput>& segments, float scale,
                   const std::string& mask_mode, const std::optional<mx::array>& mask, const std::string& scores,
                   const std::optional<mx::array>& sinks) {
  Checked c{};
  if (q.ndim() != 4) fail("q must have 4 dimensions (B, Hq, L, D), got shape " + shape_str(q.shape()));
  if (!is_float_dtype(q.dtype())) fail("q's dtype must be float32, float16 or bfloat16");
  c.B = q.shape(0), c.Hq = q.shape(1), c.L = q.shape(2), c.Dk = q.shape(3);
  if (segments.empty()) fail("at least one K/V segment is needed");
  if (static_cast<int>(segments.size()) > MAX_SEGMENTS)
    fail("at most " + std::to_string(MAX_SEGMENTS) + " K/V segments, got " + std::to_string(segments.size()));
  c.Hkv = -1;
  c.Dv = -1;
  for (size_t i = 0; i < segments.size(); ++i) {
    const KVShape k = check_kv(segments[i].k, "k", static_cast<int>(i));
    const KVShape v = check_kv(segments[i].v, "v", static_cast<int>(i));
    if (k.B != v.B || k.H != v.H || k.n != v.n)
      fail("k and v must agree on (B, Hkv, N), got (" + std::to_string(k.B) + ", " + std::to_string(k.H) + ", " +
           std::to_string(k.n) + ") and (" + std::to_string(v.B) + ", " + std::to_string(v.H) + ", " +
           std::to_string(v.n) + ") in segment " + std::to_string(i));
    if (k.B != c.B) fail("q and k must have the same batch size, got " + std::to_string(c.B) + " and " + std::to_string(k.B));
    if (k.D != c.Dk) fail("q and k must have the same head dim, got " + std::to_string(c.Dk) + " and " + std::to_string(k.D));
    if (c.Hkv >= 0 && (k.H != c.Hkv || v.D != c.Dv)) fail("every segment must have the same kv heads and value head dim");
    c.Hkv = k.H;
    c.Dv = v.D;
    if (k.n > 0) c.segments.push_back(segments[i]);
    c.N += k.n;
  }
  if (c.Hq < 1 || c.L < 1 || c.N < 1 || c.Dk < 1 || c.Dv < 1 || c.B < 1 || c.Hkv < 1)
    fail("every dimension of q, k and v must be >= 1, got q " + shape_str(q.shape()) + " and " + std::to_string(c.N) + " keys");
  if (c.Hq % c.Hkv != 0)
    fail("the number of query heads (" + std::to_string(c.Hq) + ") must be a multiple of the number of kv heads (" +
         std::to_string(c.Hkv) + ")");
  if (!std::isfinite(scale)) fail("scale must be a finite number");
  c.score_mode = parse_scores(scores);
  c.mask_kind = MaskKind::none;
  if (mask_mode == "causal") {
    if (mask) fail("mask 'causal' takes no mask array");
    if (c.L > c.N)
      fail("a causal mask needs L <= N (query rows sit at positions N - L .. N - 1), got L=" + std::to_string(c.L) +
           ", N=" + std::to_string(c.N));
    c.mask_kind = MaskKind::causal;
  } else if (mask_mode == "array") {
    if (!mask) fail("mask_mode 'array' needs a mask array");
    if (mask->dtype() != mx::bool_ && !is_float_dtype(mask->dtype()))
      fail("mask must be a boolean or additive float32/float16/bfloat16 array");
    const mx::Shape target = {c.B, c.Hq, c.L, c.N};
    bool ok = mask->ndim() <= 4;
    for (int i = 0; ok && i < static_cast<int>(mask->ndim()); ++i) {
      const int d = mask->shape(-1 - i), t = target[3 - i];
      ok = d == t || d == 1;
    }
    if (!ok) fail("mask of shape " + shape_str(mask->shape()) + " does not broadcast to (B, Hq, L, N) = " + shape_str(target));
    c.mask_kind = MaskKind::array;
  } else if (!mask_mode.empty()) {
    fail("mask must be None, 'causal' or an array, got '" + mask_mode + "'");
  }
  if (sinks) {
    if (sinks->ndim() != 1 || sinks->shape(0) != c.Hq)
      fail("sinks must have shape (Hq,) = (" + std::to_string(c.Hq) + ",), got " + shape_str(sinks->shape()));
    if (!is_float_dtype(sinks->dtype())) fail("sinks' dtype must be float32, float16 or bfloat16");
  }
  return c;
}

// Reads one K or V source from the primitive's inputs at `i` (advancing it).
KVSource read_source(const std::vector<mx::array>& in, size_t& i, int bits, int group_size) {
  KVSource src;
  if (bits == 0) {
    src.dense = view_of(in[i++]);
    return src;
  }
  src.quantized = true;
  src.bits = bits;
  src.group_size = group_size;
  src.packed = view_of(in[i++]);
  src.scales = view_of(in[i++]);
  src.biases = view_of(in[i++]);
  return src;
}

void check_rotations(const Checked& c, const mx::array& q, const std::optional<mx::array>& q_rotation,
                     const std::optional<mx::array>& out_rotation) {
  if (q_rotation) check_rotation(*q_rotation, c.Dk, "q_rotation", q);
  if (out_rotation) check_rotation(*out_rotation, c.Dv, "out_rotation", q);
}

void check_column(const Checked& c, const std::optional<ScoreColumn>& column) {
  if (!column) return;
  if (c.score_mode != ScoreMode::mass) fail("a score column takes scores 'mass'");
  const auto& acc = column->acc;
  if (acc.dtype() != mx::float32 || acc.ndim() != 3 || acc.shape(0) != c.B || acc.shape(1) != c.Hkv || acc.shape(2) < c.N)
    fail("the score column must be float32 (B, Hkv, C >= N) = (" + std::to_string(c.B) + ", " + std::to_string(c.Hkv) +
         ", >= " + std::to_string(c.N) + "), got " + shape_str(acc.shape()));
  if (column->held < 0 || column->held > acc.shape(2))
    fail("the score column's held must be in [0, " + std::to_string(acc.shape(2)) + "], got " + std::to_string(column->held));
}

}  // namespace

namespace {
std::atomic<bool>& int8_setting() {
  static std::atomic<bool> enabled{[] {
    const char* env = std::getenv("MLX_H2O_ATTENTION_INT8");
    return !(env && env[0] == '0');
  }()};
  return enabled;
}
}  // namespace

bool attention_int8_queries() { return int8_setting().load(); }
void set_attention_int8_queries(bool enabled) { int8_setting().store(enabled); }

std::vector<mx::array> attention_with_scores_composed(const mx::array& q_in, const std::vector<SegmentInput>& segments,
                                                      float scale, const std::string& mask_mode,
                                                      const std::optional<mx::array>& mask, const std::string& scores,
                                                      const std::optional<mx::array>& sinks,
                                                      const std::optional<mx::array>& q_rotation,
                                                      const std::optional<mx::array>& out_rotation,
                                                      const std::optional<ScoreColumn>& column, mx::StreamOrDevice s) {
  const Checked c = check_args(q_in, segments, scale, mask_mode, mask, scores, sinks);
  check_rotations(c, q_in, q_rotation, out_rotation);
  check_column(c, column);
  using namespace mlx::core;
  const auto q = q_rotation ? rotated(q_in, *q_rotation, float32, s) : q_in;
  const int B = c.B, Hq = c.Hq, Hkv = c.Hkv, L = c.L, N = c.N, G = Hq / Hkv;
  auto dense = [&](const KVInput& in) {
    auto a = [&](int i) { return leading(in.arrays[i], in.rows, s); };
    if (!in.quantized()) return astype(a(0), float32, s);
    // float32 scales: MLX's dequantize computes in the scales' dtype, which would round through f16.
    return dequantize(a(0), astype(a(1), float32, s), astype(a(2), float32, s), in.group_size, in.bits, "affine", {},
                      std::nullopt, s);
  };
  std::vector<array> ks, vs;
  for (const auto& seg : c.segments) {
    ks.push_back(dense(seg.k));
    vs.push_back(dense(seg.v));
  }
  auto kf = expand_dims(ks.size() == 1 ? ks[0] : concatenate(ks, 2, s), 2, s);  // (B, Hkv, 1, N, Dk)
  auto vf = expand_dims(vs.size() == 1 ? vs[0] : concatenate(vs, 2, s), 2, s);
  auto qg = multiply(reshape(astype(q, float32, s), {B, Hkv, G, L, c.Dk}, s), array(scale, float32), s);
  auto logits = matmul(qg, swapaxes(kf, -1, -2, s), s);  // (B, Hkv, G, L, N)
  const auto neg_inf = array(-std::numeric_limits<float>::infinity(), float32);
  if (c.mask_kind == MaskKind::causal) {
    auto rows = reshape(arange(N - L, N, s), {L, 1}, s);
    auto cols = reshape(arange(0, N, s), {1, N}, s);
    logits = where(greater_equal(rows, cols, s), logits, neg_inf, s);
  } else if (c.mask_kind == MaskKind::array) {
    auto m = reshape(broadcast_to(*mask, {B, Hq, L, N}, s), {B, Hkv, G, L, N}, s);
    logits = m.dtype() == bool_ ? where(m, logits, neg_inf, s) : add(logits, astype(m, float32, s), s);
  }
  array probs = logits;
  if (sinks) {
    auto sink = broadcast_to(reshape(astype(*sinks, float32, s), {1, Hkv, G, 1, 1}, s), {B, Hkv, G, L, 1}, s);
    auto full = softmax(concatenate({sink, logits}, -1, s), std::vector<int>{-1}, true, s);
    probs = slice(full, {0, 0, 0, 0, 1}, {B, Hkv, G, L, N + 1}, s);
  } else {
    probs = softmax(logits, std::vector<int>{-1}, true, s);
  }
  // A row whose every key is masked (and no sink) attends to nothing: zero output, no mass.
  auto seen = any(greater(logits, neg_inf, s), std::vector<int>{-1}, true, s);
  probs = where(seen, probs, array(0.0f, float32), s);
  auto out = reshape(matmul(probs, vf, s), {B, Hq, L, c.Dv}, s);
  out = out_rotation ? rotated(out, *out_rotation, q_in.dtype(), s) : astype(out, q_in.dtype(), s);
  if (c.score_mode == ScoreMode::mass) {
    auto mass = sum(probs, std::vector<int>{2, 3}, false, s);
    if (column) return {out, mass, accumulate_prefix(column->acc, mass, column->alpha, column->beta, column->held, s)};
    return {out, mass};
  }
  if (c.score_mode == ScoreMode::logits) return {out, reshape(logits, {B, Hq, L, N}, s)};
  return {out};
}

std::vector<mx::array> attention_with_scores(const mx::array& q, const std::vector<SegmentInput>& segments, float scale,
                                             const std::string& mask_mode, const std::optional<mx::array>& mask,
                                             const std::string& scores, const std::optional<mx::array>& sinks,
                                             const std::optional<mx::array>& q_rotation,
                                             const std::optional<mx::array>& out_rotation,
                                             const std::optional<ScoreColumn>& column, mx::StreamOrDevice s) {
  const Checked c = check_args(q, segments, scale, mask_mode, mask, scores, sinks);
  check_rotations(c, q, q_rotation, out_rotation);
  check_column(c, column);
  auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu)
    return attention_with_scores_composed(q, segments, scale, mask_mode, mask, scores, sinks, q_rotation, out_rotation,
                                          column, stream);

  std::vector<mx::array> inputs = {q};
  std::vector<SegmentFormat> formats;
  for (const auto& seg : c.segments) {
    SegmentFormat f;
    if (seg.k.quantized()) f.k_bits = seg.k.bits, f.k_group_size = seg.k.group_size;
    if (seg.v.quantized()) f.v_bits = seg.v.bits, f.v_group_size = seg.v.group_size;
    if (seg.k.rows >= 0 || seg.v.rows >= 0) f.rows = rows_read(seg.k);  // (check_args: K and V read as many)
    formats.push_back(f);
    inputs.insert(inputs.end(), seg.k.arrays.begin(), seg.k.arrays.end());
    inputs.insert(inputs.end(), seg.v.arrays.begin(), seg.v.arrays.end());
  }
  if (c.mask_kind == MaskKind::array) inputs.push_back(mx::broadcast_to(*mask, {c.B, c.Hq, c.L, c.N}, stream));
  if (sinks) inputs.push_back(*sinks);
  if (q_rotation) inputs.push_back(*q_rotation);
  if (out_rotation) inputs.push_back(*out_rotation);
  std::optional<AttentionWithScores::Fold> fold;
  if (column) {
    inputs.push_back(column->acc);
    fold = AttentionWithScores::Fold{column->alpha, column->beta, column->held};
  }
  std::vector<mx::Shape> shapes = {{c.B, c.Hq, c.L, c.Dv}};
  std::vector<mx::Dtype> dtypes = {q.dtype()};
  if (c.score_mode == ScoreMode::mass) {
    shapes.push_back({c.B, c.Hkv, c.N});
    dtypes.push_back(mx::float32);
    if (column) {
      shapes.push_back(column->acc.shape());
      dtypes.push_back(mx::float32);
    }
  } else if (c.score_mode == ScoreMode::logits) {
    shapes.push_back({c.B, c.Hq, c.L, c.N});
    dtypes.push_back(mx::float32);
  }
  return mx::array::make_arrays(
      std::move(shapes), dtypes,
      std::make_shared<AttentionWithScores>(stream, scale, c.mask_kind, c.score_mode, sinks.has_value(), std::move(formats),
                                            attention_int8_queries(), q_rotation.has_value(), out_rotation.has_value(), fold),
      inputs);
}

void AttentionWithScores::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  std::vector<mx::array> in = inputs;
  // The kernel reads K/V rows as contiguous vectors; any other layout is copied once.
  size_t n_kv = 0;
  for (const auto& f : formats_) n_kv += (f.k_bits ? 3 : 1) + (f.v_bits ? 3 : 1);
  for (size_t i = 1; i <= n_kv; ++i)
    if (needs_copy(in[i])) in[i] = contiguous_copy(in[i], enc);
  // The rotations read rows of unit stride: q's, and the matrices' (row-major).
  if (q_rotated_ && needs_copy(in[0])) in[0] = contiguous_copy(in[0], enc);
  // The rotations read rows of unit stride, the column whole rows: copied unless row-contiguous.
  for (size_t r = in.size() - q_rotated_ - out_rotated_ - fold_.has_value(); r < in.size(); ++r)
    if (!in[r].flags().row_contiguous) in[r] = contiguous_copy(in[r], enc);

  AttentionProblem p;
  const auto& q = in[0];
  p.B = q.shape(0), p.Hq = q.shape(1), p.L = q.shape(2), p.Dk = q.shape(3);
  p.q = view_of(q);
  p.scale = scale_;
  size_t i = 1;
  int begin = 0;
  p.n_segments = static_cast<int>(formats_.size());
  for (int sidx = 0; sidx < p.n_segments; ++sidx) {
    const auto& f = formats_[sidx];
    KVSegment& seg = p.segments[sidx];
    const auto& k0 = in[i];
    seg.begin = begin;
    seg.length = f.rows >= 0 ? f.rows : k0.shape(2);
    p.Hkv = k0.shape(1);
    seg.k = read_source(in, i, f.k_bits, f.k_group_size);
    const auto& v0 = in[i];
    p.Dv = f.v_bits ? static_cast<int>(static_cast<int64_t>(v0.shape(3)) * 32 / f.v_bits) : v0.shape(3);
    seg.v = read_source(in, i, f.v_bits, f.v_group_size);
    begin += seg.length;
  }
  p.N = begin;
  p.mask_kind = mask_kind_;
  if (mask_kind_ == MaskKind::array) p.mask = view_of(in[i++]);
  if (has_sinks_) {
    const auto& sk = in[i++];
    p.sinks = sk.data<void>();
    p.sinks_type = elem_type(sk.dtype());
    p.sinks_stride = sk.strides()[0];
  }
  const float* q_rotation = q_rotated_ ? in[i++].data<float>() : nullptr;
  const float* out_rotation = out_rotated_ ? in[i++].data<float>() : nullptr;
  const float* column = fold_ ? in[i++].data<float>() : nullptr;
  // (The column is written into a buffer of its own: an input of a multi-output primitive is never donatable.)
  for (auto& o : outputs) o.set_data(mx::allocator::malloc(o.nbytes()));
  p.out = outputs[0].data<void>();
  p.out_type = elem_type(outputs[0].dtype());
  p.score_mode = score_mode_;
  p.scores = score_mode_ == ScoreMode::none ? nullptr : outputs[1].data<float>();
  p.threads = kernel_threads();
  p.int8_queries = int8_queries_;
  for (auto& a : in) enc.set_input_array(a);
  for (auto& o : outputs) enc.set_output_array(o);
  // The mass of this call folded into the score column, after the kernel wrote it.
  std::function<void()> fold_column = [] {};
  if (fold_) {
    const int64_t C = outputs[2].shape(2);
    fold_column = [column, mass = p.scores, out = outputs[2].data<float>(), rows = int64_t{p.B} * p.Hkv, C, N = p.N,
                   f = *fold_]() { accumulate_prefix_rows(column, mass, out, rows, C, N, f.held, f.alpha, f.beta); };
  }
  if (!q_rotation && !out_rotation) {
    enc.dispatch([p, fold_column]() {
      attention_cpu(p);
      fold_column();
    });
    return;
  }
  // A rotated cache's queries and output, rotated around the kernel in float32 scratch.
  enc.dispatch([p, q_rotation, out_rotation, fold_column, q_dtype = q.dtype(), out_dtype = outputs[0].dtype()]() mutable {
    const int64_t rows = static_cast<int64_t>(p.B) * p.Hq * p.L;
    std::vector<float> q_rotated, out_unrotated;
    if (q_rotation) {
      const RotationPlan plan(q_rotation, p.Dk);
      q_rotated.resize(rows * p.Dk);
      const auto* base = static_cast<const char*>(p.q.data);
      const int64_t itemsize = mx::size_of(q_dtype);
      for (int b = 0; b < p.B; ++b)  // each (batch, head): its L rows, p.q.stride[2] apart
        for (int h = 0; h < p.Hq; ++h)
          rotate_rows_cpu(base + (b * p.q.stride[0] + h * p.q.stride[1]) * itemsize, q_dtype, p.q.stride[2], plan,
                          q_rotated.data() + (int64_t{b} * p.Hq + h) * p.L * p.Dk, mx::float32, p.L, p.Dk);
      p.q.data = q_rotated.data();
      p.q.type = ElemType::float32;
      p.q.stride[0] = int64_t{p.Hq} * p.L * p.Dk, p.q.stride[1] = int64_t{p.L} * p.Dk, p.q.stride[2] = p.Dk, p.q.stride[3] = 1;
    }
    void* out = p.out;
    if (out_rotation) {
      out_unrotated.resize(rows * p.Dv);
      p.out = out_unrotated.data();
      p.out_type = ElemType::float32;
    }
    attention_cpu(p);
    fold_column();
    if (out_rotation)
      rotate_rows_cpu(out_unrotated.data(), mx::float32, p.Dv, RotationPlan(out_rotation, p.Dv), out, out_dtype, rows, p.Dv);
  });
}

std::vector<mx::array> AttentionWithScores::composed(const std::vector<mx::array>& inputs) {
  std::vector<SegmentInput> segments;
  size_t i = 1;
  auto take = [&](int bits, int group_size, int rows) {
    KVInput in{{inputs[i]}, bits, group_size, rows};
    if (bits) in.arrays = {inputs[i], inputs[i + 1], inputs[i + 2]};
    i += bits ? 3 : 1;
    return in;
  };
  for (const auto& f : formats_) {
    KVInput k = take(f.k_bits, f.k_group_size, f.rows);
    segments.push_back({std::move(k), take(f.v_bits, f.v_group_size, f.rows)});
  }
  std::optional<mx::array> mask, sinks, q_rotation, out_rotation;
  if (mask_kind_ == MaskKind::array) mask = inputs[i++];
  if (has_sinks_) sinks = inputs[i++];
  if (q_rotated_) q_rotation = inputs[i++];
  if (out_rotated_) out_rotation = inputs[i++];
  std::optional<ScoreColumn> column;
  if (fold_) column = ScoreColumn{inputs[i++], fold_->alpha, fold_->beta, fold_->held};
  const char* mode = mask_kind_ == MaskKind::causal ? "causal" : mask_kind_ == MaskKind::array ? "array" : "";
  const char* scores = score_mode_ == ScoreMode::mass ? "mass" : score_mode_ == ScoreMode::logits ? "logits" : "";
  return attention_with_scores_composed(inputs[0], segments, scale_, mode, mask, scores, sinks, q_rotation, out_rotation,
                                        column, stream());
}

void AttentionWithScores::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  // The ops build the composed graph for GPU streams, so this primitive never runs there.
  throw std::runtime_error("[attention_with_scores] no GPU kernel; the op uses the composed path on GPU streams");
}

bool AttentionWithScores::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const AttentionWithScores&>(other);
  return scale_ == o.scale_ && mask_kind_ == o.mask_kind_ && score_mode_ == o.score_mode_ &&
         has_sinks_ == o.has_sinks_ && formats_ == o.formats_ && int8_queries_ == o.int8_queries_ &&
         q_rotated_ == o.q_rotated_ && out_rotated_ == o.out_rotated_ && fold_ == o.fold_;
}

std::vector<mx::Shape> AttentionWithScores::output_shapes(const std::vector<mx::array>& inputs) {
  const auto& q = inputs[0];
  int N = 0, Hkv = 0, Dv = 0;
  size_t i = 1;
  for (const auto& f : formats_) {
    N += f.rows >= 0 ? f.rows : inputs[i].shape(2);
    Hkv = inputs[i].shape(1);
    i += f.k_bits ? 3 : 1;
    Dv = f.v_bits ? static_cast<int>(static_cast<int64_t>(inputs[i].shape(3)) * 32 / f.v_bits) : inputs[i].shape(3);
    i += f.v_bits ? 3 : 1;
  }
  std::vector<mx::Shape> shapes = {{q.shape(0), q.shape(1), q.shape(2), Dv}};
  if (score_mode_ == ScoreMode::mass) shapes.push_back({q.shape(0), Hkv, N});
  if (fold_) shapes.push_back(inputs.back().shape());  // the column, the last input
  if (score_mode_ == ScoreMode::logits) shapes.push_back({q.shape(0), q.shape(1), q.shape(2), N});
  return shapes;
}

}  // namespace mlx_h2o
