#include "scaled_dot_product_attention_with_scores.h"

#include <cmath>
#include <cstring>
#include <sstream>
#include <stdexcept>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

#include "parallel.h"

namespace mlx_h2o {

namespace {

std::string shape_str(const mx::Shape& s) {
  std::ostringstream os;
  os << "(";
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << (s.size() == 1 ? ",)" : ")");
  return os.str();
}

[[noreturn]] void fail(const char* op, const std::string& msg) {
  throw std::invalid_argument(std::string("[") + op + "] " + msg);
}

bool is_float_dtype(mx::Dtype t) { return t == mx::float32 || t == mx::float16 || t == mx::bfloat16; }

ElemType elem_type(mx::Dtype t) {
  if (t == mx::float32) return ElemType::float32;
  if (t == mx::float16) return ElemType::float16;
  if (t == mx::bfloat16) return ElemType::bfloat16;
  if (t == mx::bool_) return ElemType::boolean;
  throw std::invalid_argument("[mlx_h2o] unsupported dtype");
}

ScoreMode parse_scores(const char* op, const std::string& scores) {
  if (scores == "mass") return ScoreMode::mass;
  if (scores == "logits") return ScoreMode::logits;
  if (scores.empty() || scores == "none") return ScoreMode::none;
  fail(op, "scores must be one of 'mass', 'logits' or None, got '" + scores + "'");
}

// Copies a strided array into a row-contiguous buffer inside the stream's queue (the source is only
// valid once earlier tasks ran). Used for the rare K/V whose last axis is not unit-stride.
mx::array contiguous_copy(const mx::array& a, mx::cpu::CommandEncoder& enc) {
  mx::array out(a.shape(), a.dtype(), nullptr, {});
  out.set_data(mx::allocator::malloc(out.nbytes()));
  enc.add_temporary(out);
  const size_t es = a.itemsize();
  const auto shape = a.shape();
  const auto strides = a.strides();
  enc.dispatch([src = static_cast<const char*>(a.data<void>()), dst = static_cast<char*>(out.data<void>()), es,
                shape, strides]() {
    const int nd = static_cast<int>(shape.size());
    std::vector<int64_t> idx(nd, 0);
    int64_t total = 1;
    for (auto d : shape) total *= d;
    for (int64_t i = 0; i < total; ++i) {
      int64_t off = 0;
      for (int d = 0; d < nd; ++d) off += idx[d] * strides[d];
      std::memcpy(dst + i * es, src + off * es, es);
      for (int d = nd - 1; d >= 0; --d) {
        if (++idx[d] < shape[d]) break;
        idx[d] = 0;
      }
    }
  });
  return out;
}

}  // namespace

View4 view_of(const mx::array& a) {
  View4 v;
  v.data = a.data<void>();
  v.type = elem_type(a.dtype());
  const int nd = static_cast<int>(a.ndim());
  for (int i = 0; i < 4; ++i) v.stride[i] = i < nd ? a.strides()[i] : 0;
  return v;
}

AttentionArgs check_attention_args(const char* op, const mx::array& q, int B, int Hkv, int N, int Dk, float scale,
                                   const std::string& mask_mode, const std::optional<mx::array>& mask,
                                   const std::string& scores, const std::optional<mx::array>& sinks) {
  if (q.ndim() != 4) fail(op, "q must have 4 dimensions (B, Hq, L, D), got shape " + shape_str(q.shape()));
  if (!is_float_dtype(q.dtype())) fail(op, "q's dtype must be float32, float16 or bfloat16");
  const int Hq = q.shape(1), L = q.shape(2);
  if (q.shape(0) != B) fail(op, "q and k must have the same batch size, got " + shape_str(q.shape()) + " and B=" + std::to_string(B));
  if (q.shape(3) != Dk) fail(op, "q and k must have the same head dim, got " + std::to_string(q.shape(3)) + " and " + std::to_string(Dk));
  if (Hq < 1 || L < 1 || N < 1 || Dk < 1 || B < 1 || Hkv < 1)
    fail(op, "every dimension of q, k and v must be >= 1, got q " + shape_str(q.shape()));
  if (Hq % Hkv != 0)
    fail(op, "the number of query heads (" + std::to_string(Hq) + ") must be a multiple of the number of kv heads (" +
                 std::to_string(Hkv) + ")");
  if (!std::isfinite(scale)) fail(op, "scale must be a finite number");
  AttentionArgs args{MaskKind::none, parse_scores(op, scores)};
  if (mask_mode == "causal") {
    if (mask) fail(op, "mask 'causal' takes no mask array");
    if (L > N) fail(op, "a causal mask needs L <= N (query rows sit at positions N - L .. N - 1), got L=" +
                            std::to_string(L) + ", N=" + std::to_string(N));
    args.mask_kind = MaskKind::causal;
  } else if (mask_mode == "array") {
    if (!mask) fail(op, "mask_mode 'array' needs a mask array");
    if (mask->dtype() != mx::bool_ && !is_float_dtype(mask->dtype()))
      fail(op, "mask must be a boolean or additive float32/float16/bfloat16 array");
    mx::Shape target = {B, Hq, L, N};
    bool ok = mask->ndim() <= 4;
    for (int i = 0; ok && i < static_cast<int>(mask->ndim()); ++i) {
      int d = mask->shape(-1 - i), t = target[3 - i];
      ok = d == t || d == 1;
    }
    if (!ok) fail(op, "mask of shape " + shape_str(mask->shape()) + " does not broadcast to (B, Hq, L, N) = " + shape_str(target));
    args.mask_kind = MaskKind::array;
  } else if (!mask_mode.empty()) {
    fail(op, "mask must be None, 'causal' or an array, got '" + mask_mode + "'");
  }
  if (sinks) {
    if (sinks->ndim() != 1 || sinks->shape(0) != Hq)
      fail(op, "sinks must have shape (Hq,) = (" + std::to_string(Hq) + ",), got " + shape_str(sinks->shape()));
    if (!is_float_dtype(sinks->dtype())) fail(op, "sinks' dtype must be float32, float16 or bfloat16");
  }
  return args;
}

namespace {

void check_dense_kv(const char* op, const mx::array& q, const mx::array& k, const mx::array& v) {
  if (k.ndim() != 4 || v.ndim() != 4)
    fail(op, "k and v must have 4 dimensions (B, Hkv, N, D), got " + shape_str(k.shape()) + " and " + shape_str(v.shape()));
  if (!is_float_dtype(k.dtype()) || k.dtype() != v.dtype())
    fail(op, "k and v must share one dtype among float32, float16, bfloat16");
  if (k.shape(0) != v.shape(0) || k.shape(1) != v.shape(1) || k.shape(2) != v.shape(2))
    fail(op, "k and v must agree on (B, Hkv, N), got " + shape_str(k.shape()) + " and " + shape_str(v.shape()));
  if (v.shape(3) < 1) fail(op, "v's head dim must be >= 1");
  (void)q;
}

}  // namespace

std::vector<mx::array> attention_with_scores_composed(const mx::array& q, const mx::array& k, const mx::array& v,
                                                      float scale, const std::string& mask_mode,
                                                      const std::optional<mx::array>& mask, const std::string& scores,
                                                      const std::optional<mx::array>& sinks, mx::StreamOrDevice s) {
  const char* op = "attention_with_scores_composed";
  check_dense_kv(op, q, k, v);
  const int B = k.shape(0), Hkv = k.shape(1), N = k.shape(2);
  auto args = check_attention_args(op, q, B, Hkv, N, k.shape(3), scale, mask_mode, mask, scores, sinks);
  const int Hq = q.shape(1), L = q.shape(2), G = Hq / Hkv, Dk = q.shape(3), Dv = v.shape(3);
  using namespace mlx::core;
  auto qg = multiply(reshape(astype(q, float32, s), {B, Hkv, G, L, Dk}, s), array(scale, float32), s);
  auto kf = expand_dims(astype(k, float32, s), 2, s);
  auto vf = expand_dims(astype(v, float32, s), 2, s);
  auto logits = matmul(qg, swapaxes(kf, -1, -2, s), s);  // (B, Hkv, G, L, N)
  const auto neg_inf = array(-std::numeric_limits<float>::infinity(), float32);
  if (args.mask_kind == MaskKind::causal) {
    auto rows = reshape(arange(N - L, N, s), {L, 1}, s);
    auto cols = reshape(arange(0, N, s), {1, N}, s);
    logits = where(greater_equal(rows, cols, s), logits, neg_inf, s);
  } else if (args.mask_kind == MaskKind::array) {
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
  auto out = astype(reshape(matmul(probs, vf, s), {B, Hq, L, Dv}, s), q.dtype(), s);
  if (args.score_mode == ScoreMode::mass) return {out, sum(probs, std::vector<int>{2, 3}, false, s)};
  if (args.score_mode == ScoreMode::logits) return {out, reshape(logits, {B, Hq, L, N}, s)};
  return {out};
}

std::vector<mx::array> scaled_dot_product_attention_with_scores(const mx::array& q, const mx::array& k,
                                                                const mx::array& v, float scale,
                                                                const std::string& mask_mode,
                                                                const std::optional<mx::array>& mask,
                                                                const std::string& scores,
                                                                const std::optional<mx::array>& sinks,
                                                                mx::StreamOrDevice s) {
  const char* op = "scaled_dot_product_attention_with_scores";
  check_dense_kv(op, q, k, v);
  const int B = k.shape(0), Hkv = k.shape(1), N = k.shape(2);
  auto args = check_attention_args(op, q, B, Hkv, N, k.shape(3), scale, mask_mode, mask, scores, sinks);
  auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu)
    return attention_with_scores_composed(q, k, v, scale, mask_mode, mask, scores, sinks, stream);

  const int Hq = q.shape(1), L = q.shape(2), Dv = v.shape(3);
  std::vector<mx::array> inputs = {q, k, v};
  if (args.mask_kind == MaskKind::array) inputs.push_back(mx::broadcast_to(*mask, {B, Hq, L, N}, stream));
  if (sinks) inputs.push_back(*sinks);
  std::vector<mx::Shape> shapes = {{B, Hq, L, Dv}};
  std::vector<mx::Dtype> dtypes = {q.dtype()};
  if (args.score_mode == ScoreMode::mass) {
    shapes.push_back({B, Hkv, N});
    dtypes.push_back(mx::float32);
  } else if (args.score_mode == ScoreMode::logits) {
    shapes.push_back({B, Hq, L, N});
    dtypes.push_back(mx::float32);
  }
  return mx::array::make_arrays(
      std::move(shapes), dtypes,
      std::make_shared<ScaledDotProductAttentionWithScores>(stream, scale, args.mask_kind, args.score_mode,
                                                            sinks.has_value()),
      inputs);
}

void fill_common_problem(AttentionProblem& p, const std::vector<mx::array>& inputs, int first_optional,
                         MaskKind mask_kind, bool has_sinks, ScoreMode score_mode, std::vector<mx::array>& outputs) {
  const auto& q = inputs[0];
  p.B = q.shape(0);
  p.Hq = q.shape(1);
  p.L = q.shape(2);
  p.Dk = q.shape(3);
  p.q = view_of(q);
  p.mask_kind = mask_kind;
  int i = first_optional;
  if (mask_kind == MaskKind::array) p.mask = view_of(inputs[i++]);
  if (has_sinks) {
    const auto& sk = inputs[i++];
    p.sinks = sk.data<void>();
    p.sinks_type = elem_type(sk.dtype());
    p.sinks_stride = sk.strides()[0];
  }
  for (auto& o : outputs) o.set_data(mx::allocator::malloc(o.nbytes()));
  p.out = outputs[0].data<void>();
  p.out_type = elem_type(outputs[0].dtype());
  p.score_mode = score_mode;
  p.scores = score_mode == ScoreMode::none ? nullptr : outputs[1].data<float>();
  p.threads = kernel_threads();
}

void ScaledDotProductAttentionWithScores::eval_cpu(const std::vector<mx::array>& inputs,
                                                   std::vector<mx::array>& outputs) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  std::vector<mx::array> in = inputs;
  // The kernel reads K/V rows as contiguous vectors; any other layout is copied once.
  for (int i : {1, 2})
    if (in[i].strides().back() != 1 && in[i].shape().back() > 1) in[i] = contiguous_copy(in[i], enc);
  AttentionProblem p;
  fill_common_problem(p, in, 3, mask_kind_, has_sinks_, score_mode_, outputs);
  p.Hkv = in[1].shape(1);
  p.N = in[1].shape(2);
  p.Dv = in[2].shape(3);
  p.scale = scale_;
  p.k = view_of(in[1]);
  p.v = view_of(in[2]);
  for (auto& a : in) enc.set_input_array(a);
  for (auto& o : outputs) enc.set_output_array(o);
  enc.dispatch([p]() { attention_cpu(p); });
}

void ScaledDotProductAttentionWithScores::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  // The op builds the composed graph for GPU streams, so this primitive never runs there.
  throw std::runtime_error("[scaled_dot_product_attention_with_scores] no GPU kernel; use the composed path");
}

bool ScaledDotProductAttentionWithScores::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const ScaledDotProductAttentionWithScores&>(other);
  return scale_ == o.scale_ && mask_kind_ == o.mask_kind_ && score_mode_ == o.score_mode_ &&
         has_sinks_ == o.has_sinks_;
}

std::vector<mx::Shape> ScaledDotProductAttentionWithScores::output_shapes(const std::vector<mx::array>& inputs) {
  const auto& q = inputs[0];
  const auto& k = inputs[1];
  const auto& v = inputs[2];
  std::vector<mx::Shape> shapes = {{q.shape(0), q.shape(1), q.shape(2), v.shape(3)}};
  if (score_mode_ == ScoreMode::mass) shapes.push_back({k.shape(0), k.shape(1), k.shape(2)});
  if (score_mode_ == ScoreMode::logits) shapes.push_back({q.shape(0), q.shape(1), q.shape(2), k.shape(2)});
  return shapes;
}

}  // namespace mlx_h2o
