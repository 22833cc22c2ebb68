#include "quantized_matmul.h"

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <stdexcept>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/fast.h"

#include "kernels/exp_ops_problem.h"
#include "kernels/norm_rope_problem.h"
#include "kernels/quantized_matmul_problem.h"
#include "exp_ops.h"
#include "norm_rope.h"
#include "op_utils.h"
#include "parallel.h"

// The GEMM libmlx links (MLX's CPU matmul calls it; mlx_h2o.use_openblas() routes it to OpenBLAS).
extern "C" void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha, const float* a,
                            int lda, const float* b, int ldb, float beta, float* c, int ldc);

namespace mlx_h2o {

namespace {

constexpr int CBLAS_ROW_MAJOR = 101, CBLAS_NO_TRANS = 111, CBLAS_TRANS = 112;

// Checks W = (w, scales, biases); returns K, the columns of W.
int check_weights(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size, int bits) {
  if (group_size != 32 && group_size != 64 && group_size != 128)
    fail("group_size must be one of 32, 64, 128, got " + std::to_string(group_size));
  if (w.ndim() != 2 || w.dtype() != mx::uint32)
    fail("w must be a 2-D uint32 array (N, K * bits / 32) as mx.quantize returns, got shape " + shape_str(w.shape()));
  if (scales.ndim() != 2 || scales.shape() != biases.shape())
    fail("scales and biases must be 2-D arrays of the same shape (N, K / group_size)");
  if (!is_float_dtype(scales.dtype()) || scales.dtype() != biases.dtype())
    fail("scales and biases must share one dtype among float32, float16, bfloat16");
  const int64_t bits_total = static_cast<int64_t>(w.shape(1)) * 32;
  const int K = bits_total % bits ? -1 : static_cast<int>(bits_total / bits);
  if (K < 0 || K % group_size != 0 || scales.shape(0) != w.shape(0) || scales.shape(1) != K / group_size)
    fail("scales " + shape_str(scales.shape()) + " do not match w " + shape_str(w.shape()) + " with bits " +
         std::to_string(bits) + " and group_size " + std::to_string(group_size) +
         " (do bits and group_size match the ones used to quantize?)");
  return K;
}

// Checks W for the dequantizing ops (dequantize_affine, quantized_embedding: bits 2-8); returns K.
int check_dequantized_weights(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size,
                              int bits) {
  if (bits < 2 || bits > 8 || bits == 7) fail("bits must be one of 2, 3, 4, 5, 6, 8, got " + std::to_string(bits));
  return check_weights(w, scales, biases, group_size, bits);
}

// Checks the arguments of quantized_matmul; returns K (x's last axis, or half of it for a packed
// gate/up product whose swiglu is the product's input).
int check_args(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
               int group_size, int bits, bool swiglu = false) {
  if (bits != 4 && bits != 8) fail("bits must be one of 4, 8, got " + std::to_string(bits));
  if (x.ndim() < 1) fail("x must have at least 1 dimension (..., K)");
  if (!is_float_dtype(x.dtype())) fail("x's dtype must be float32, float16 or bfloat16");
  if (swiglu && x.shape(-1) % 2) fail("with swiglu, x's last axis holds gate and up: it must be even, got " + shape_str(x.shape()));
  const int K = swiglu ? x.shape(-1) / 2 : x.shape(-1);
  if (static_cast<int64_t>(w.ndim() == 2 ? w.shape(1) : 0) * 32 != static_cast<int64_t>(K) * bits)
    fail("w's words per row do not hold K = " + std::to_string(K) + " " + std::to_string(bits) +
         "-bit values (x's last axis), w has shape " + shape_str(w.shape()));
  check_weights(w, scales, biases, group_size, bits);
  return K;
}

PackedWeights packed_weights(const mx::array& w, const mx::array& sc, const mx::array& bi, int group_size, int bits) {
  PackedWeights W;
  W.N = w.shape(0);
  W.K = static_cast<int>(static_cast<int64_t>(w.shape(1)) * 32 / bits);
  W.w = w.data<uint32_t>();
  W.scales = sc.data<void>();
  W.biases = bi.data<void>();
  W.scale_type = elem_type(sc.dtype());
  W.bits = bits;
  W.group_size = group_size;
  return W;
}

}  // namespace

mx::array dequantize_affine(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size,
                            int bits, mx::Dtype dtype, mx::StreamOrDevice s) {
  const int K = check_dequantized_weights(w, scales, biases, group_size, bits);
  if (!is_float_dtype(dtype)) fail("dtype must be float32, float16 or bfloat16");
  auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu)
    return mx::astype(mx::dequantize(w, scales, biases, group_size, bits, "affine", {}, std::nullopt, stream), dtype,
                      stream);
  return mx::array({w.shape(0), K}, dtype, std::make_shared<DequantizeAffine>(stream, group_size, bits, dtype),
                   {w, scales, biases});
}

mx::array quantized_embedding(const mx::array& indices, const mx::array& w, const mx::array& scales,
                              const mx::array& biases, int group_size, int bits, mx::StreamOrDevice s) {
  const int K = check_dequantized_weights(w, scales, biases, group_size, bits);
  if (indices.dtype() != mx::int32 && indices.dtype() != mx::uint32)
    fail("indices must be int32 or uint32 token ids");
  auto stream = mx::to_stream(s);
  mx::Shape shape = indices.shape();
  shape.push_back(K);
  if (stream.device != mx::Device::cpu || indices.size() == 0)
    return mx::astype(mx::dequantize(mx::take(w, indices, 0, stream), mx::take(scales, indices, 0, stream),
                                     mx::take(biases, indices, 0, stream), group_size, bits, "affine", {}, std::nullopt,
                                     stream),
                      scales.dtype(), stream);
  return mx::array(std::move(shape), scales.dtype(),
                   std::make_shared<DequantizeAffine>(stream, group_size, bits, scales.dtype(), true),
                   {w, scales, biases, indices});
}

mx::array quantized_matmul_composed(const mx::array& x, const mx::array& w, const mx::array& scales,
                                    const mx::array& biases, int group_size, int bits, mx::StreamOrDevice s) {
  check_args(x, w, scales, biases, group_size, bits);
  const auto dtype = mx::promote_types(x.dtype(), scales.dtype());
  auto dense = mx::dequantize(w, scales, biases, group_size, bits, "affine", {}, std::nullopt, s);
  return mx::matmul(mx::astype(x, dtype, s), mx::swapaxes(mx::astype(dense, dtype, s), 0, 1, s), s);
}

namespace {

// The swiglu or norm and the residual of a fused product as the ops they stand for, around `product`.
// fast_norm: the norm as mx.fast.rms_norm (the definition, which derivatives come from) rather than
// the extension's kernel (what long inputs run on the CPU).
mx::array fused_composed(const mx::array& x, bool swiglu, const std::optional<mx::array>& norm_weight,
                         std::optional<float> norm_eps, const std::optional<mx::array>& residual, bool fast_norm,
                         const std::function<mx::array(const mx::array&)>& product, mx::StreamOrDevice s) {
  auto input = swiglu     ? swiglu_halves(x, s)
               : norm_eps ? (fast_norm ? mx::fast::rms_norm(x, norm_weight, *norm_eps, s)
                                       : rms_norm(x, norm_weight, *norm_eps, s))
                          : x;
  auto y = product(input);
  return residual ? mx::add(*residual, y, s) : y;
}

}  // namespace

mx::array quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                           int group_size, int bits, int max_rows, const std::optional<mx::array>& norm_weight,
                           std::optional<float> norm_eps, const std::optional<mx::array>& residual, bool swiglu,
                           bool swiglu_output, mx::StreamOrDevice s) {
  const int K = check_args(x, w, scales, biases, group_size, bits, swiglu);
  if (swiglu_output && (w.shape(0) % 2 || residual))
    fail("swiglu_output takes the halves of the product (gate, up): W needs an even number of rows and no residual, "
         "got W of " + std::to_string(w.shape(0)) + " rows" + (residual ? " and a residual" : ""));
  if (norm_weight && !norm_eps) fail("norm_weight needs norm_eps (the RMS norm fused into the product)");
  if (swiglu && norm_eps) fail("a product's input takes either the swiglu or the norm, not both");
  if (norm_weight && (norm_weight->ndim() != 1 || norm_weight->shape(0) != K || !is_float_dtype(norm_weight->dtype())))
    fail("norm_weight must be a float array of shape (K,) = (" + std::to_string(K) + ",), got " +
         shape_str(norm_weight->shape()));
  const auto x_dtype = norm_weight && norm_eps ? mx::promote_types(x.dtype(), norm_weight->dtype()) : x.dtype();
  const auto product_dtype = mx::promote_types(x_dtype, scales.dtype());
  mx::Shape shape = x.shape();
  shape.back() = w.shape(0);
  if (residual && (residual->shape() != shape || !is_float_dtype(residual->dtype())))
    fail("residual must be a float array of the product's shape " + shape_str(shape) + ", got " +
         shape_str(residual->shape()));
  auto stream = mx::to_stream(s);
  const int64_t rows = x.shape(-1) > 0 ? static_cast<int64_t>(x.size()) / x.shape(-1) : 0;
  if (max_rows < 0) max_rows = QMM_MAX_ROWS;
  // Other streams and empty products: the composed definition. On the CPU, longer x takes the blocked
  // GEMM where everything is float32 (the GEMM's dtype), else dequantize + matmul as ops.
  const bool not_cpu_kernels = stream.device != mx::Device::cpu || rows == 0 || w.shape(0) == 0;
  const bool float32_gemm = x.dtype() == mx::float32 && product_dtype == mx::float32 &&
                            (!residual || residual->dtype() == mx::float32);
  const bool gemm = !not_cpu_kernels && rows > max_rows && float32_gemm;
  if (swiglu_output && !gemm)  // the product, then its activation: two primitives
    return swiglu_halves(quantized_matmul(x, w, scales, biases, group_size, bits, max_rows, norm_weight, norm_eps,
                                          std::nullopt, swiglu, false, stream),
                         stream);
  if (not_cpu_kernels || (rows > max_rows && !float32_gemm)) {
    auto product = [&](const mx::array& xn) -> mx::array {
      if (not_cpu_kernels) return quantized_matmul_composed(xn, w, scales, biases, group_size, bits, stream);
      // prefill: one dequantize pass, then the BLAS GEMM
      auto dense = dequantize_affine(w, scales, biases, group_size, bits, product_dtype, stream);
      return mx::matmul(mx::astype(xn, product_dtype, stream), mx::swapaxes(dense, 0, 1, stream), stream);
    };
    return fused_composed(x, swiglu, norm_weight, norm_eps, residual, false, product, stream);
  }
  ProductFusion fusion;
  fusion.swiglu = swiglu;
  fusion.norm = norm_eps.has_value();
  fusion.norm_weight = fusion.norm && norm_weight.has_value();
  fusion.norm_eps = norm_eps.value_or(0.0f);
  fusion.residual = residual.has_value();
  fusion.swiglu_output = swiglu_output;
  if (swiglu_output) shape.back() /= 2;
  std::vector<mx::array> inputs = {x, w, scales, biases};
  if (fusion.norm_weight) inputs.push_back(*norm_weight);
  if (fusion.residual) inputs.push_back(*residual);
  const auto dtype = residual ? mx::promote_types(residual->dtype(), product_dtype) : product_dtype;
  return mx::array(std::move(shape), dtype,
                   std::make_shared<QuantizedMatmul>(stream, group_size, bits, fusion, max_rows), std::move(inputs));
}

namespace {

// Rows of W dequantized at a time for the GEMM: ~1 MiB of floats, a multiple of 16 rows (the GEMM's
// panels). A whole dense W of SmolLM2's MLP is 3.4 MiB, and a prefill's graph held several at once.
constexpr int64_t GEMM_BLOCK_FLOATS = int64_t(1) << 18;

// Float scratch kept on the thread that runs the products (the stream's) from one product to the next,
// as the kernels keep theirs (kernels/work.h, KeptFloats): fresh, every product of a prefill would map
// and fault in its scratch (~10 % of a 512-token prefill), and as MLX temporaries the scratch of
// every product the command queue has taken on would be held at once (a 512-token prefill's peak:
// MLX's 7 MiB higher, the process's 4 MiB). A slot is given back when a product needs under an
// eighth of it, and all of them when the thread runs a product on the kernel's rows (decode after a
// prefill).
constexpr int KEPT_SLOTS = 3;

struct Kept {
  float* p = nullptr;
  int64_t n = 0;
  ~Kept() { std::free(p); }
};

thread_local Kept kept[KEPT_SLOTS];

float* kept_scratch(int slot, int64_t floats) {
  Kept& k = kept[slot];
  if (floats > k.n || floats < k.n / 8) {
    std::free(k.p);
    k.p = floats > 0 ? static_cast<float*>(std::malloc(sizeof(float) * floats)) : nullptr;
    k.n = k.p ? floats : 0;
    if (floats > 0 && !k.p) throw std::bad_alloc();
  }
  return k.p;
}

void give_back_kept_scratch() {
  for (int slot = 0; slot < KEPT_SLOTS; ++slot)
    if (kept[slot].p) kept_scratch(slot, 0);
}

// The blocked GEMM's shape.
struct GemmPlan {
  int columns = 0, block = 0;  // the output's columns, W's rows (of each half) a block dequantizes
  bool swiglu_output = false;
  size_t scale_size = 4;
};

// y = x @ W^T for the GEMM's rows (float32 throughout; see quantized_matmul): x made ready (norm or
// swiglu, by the kernels the ops run), then per block of W's rows one dequantize pass into scratch and
// one GEMM into the output's columns (with swiglu_output into scratch, whose activation goes to the
// output), then the residual added.
void quantized_matmul_gemm(const QuantizedMatmulProblem& p, const GemmPlan& g) {
  const int M = p.M, N = p.W.N, K = p.W.K;
  const float* x = static_cast<const float*>(p.x);
  // (M, K): x after its norm or swiglu; (2 blocks, K): W's rows; (M, 2 block): a block's gate and up
  float* ready = p.swiglu || p.norm ? kept_scratch(0, static_cast<int64_t>(M) * K) : nullptr;
  float* dense = kept_scratch(1, static_cast<int64_t>(g.swiglu_output ? 2 : 1) * g.block * K);
  float* halves = g.swiglu_output ? kept_scratch(2, static_cast<int64_t>(M) * 2 * g.block) : nullptr;
  if (p.swiglu) {
    SwiGLUProblem s;
    s.rows = M;
    s.n = K;
    s.ld = 2 * static_cast<int64_t>(K);
    s.gate = x;
    s.up = x + K;
    s.out = ready;
    swiglu_cpu(s);
    x = ready;
  } else if (p.norm) {
    RMSNormProblem r;
    r.rows = M;
    r.D = K;
    r.x = x;
    r.weight = p.norm_weight;
    r.weight_type = p.norm_weight_type;
    r.eps = p.norm_eps;
    r.out = ready;
    rms_norm_cpu(r);
    x = ready;
  }
  float* out = static_cast<float*>(p.out);
  const int64_t words = static_cast<int64_t>(K) * p.W.bits / 32, groups = K / p.W.group_size;
  auto dequantize_rows = [&](int first, int n, float* to) {
    DequantizeProblem d;
    d.W = p.W;
    d.W.N = n;
    d.W.w = p.W.w + first * words;
    d.W.scales = static_cast<const char*>(p.W.scales) + first * groups * g.scale_size;
    d.W.biases = static_cast<const char*>(p.W.biases) + first * groups * g.scale_size;
    d.out = to;
    d.threads = p.threads;
    dequantize_cpu(d);
  };
  for (int n0 = 0; n0 < g.columns; n0 += g.block) {
    const int n = std::min(g.block, g.columns - n0);
    dequantize_rows(n0, n, dense);
    if (!g.swiglu_output) {
      cblas_sgemm(CBLAS_ROW_MAJOR, CBLAS_NO_TRANS, CBLAS_TRANS, M, n, K, 1.0f, x, K, dense, K, 0.0f, out + n0, N);
      continue;
    }
    // the gate rows [n0, n0 + n) and their up rows, N / 2 further on: the activation of columns n0 ...
    dequantize_rows(g.columns + n0, n, dense + static_cast<size_t>(n) * K);
    cblas_sgemm(CBLAS_ROW_MAJOR, CBLAS_NO_TRANS, CBLAS_TRANS, M, 2 * n, K, 1.0f, x, K, dense, K, 0.0f, halves,
                2 * n);
    for (int r = 0; r < M; ++r) {  // a row at a time: the output's rows are `columns` apart
      const float* gate = halves + static_cast<size_t>(r) * 2 * n;
      SwiGLUProblem s;
      s.n = n;
      s.gate = gate;
      s.up = gate + n;
      s.out = out + static_cast<size_t>(r) * g.columns + n0;
      swiglu_cpu(s);
    }
  }
  // The residual after the product, as the add would round it (the GEMM's beta = 1 adds it to partial
  // sums over blocks of K: other bits).
  if (p.residual) {
    const float* r = static_cast<const float*>(p.residual);
    for (int64_t i = 0, n = static_cast<int64_t>(M) * N; i < n; ++i) out[i] += r[i];
  }
}

}  // namespace

void QuantizedMatmul::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  const auto in = prepare_contiguous(inputs, outputs, enc);
  QuantizedMatmulProblem p;
  p.W = packed_weights(in[1], in[2], in[3], group_size_, bits_);
  p.M = static_cast<int>(in[0].size() / (fusion_.swiglu ? 2 * p.W.K : p.W.K));
  p.swiglu = fusion_.swiglu;
  p.x = in[0].data<void>();
  p.x_type = elem_type(in[0].dtype());
  p.out = outputs[0].data<void>();
  p.out_type = elem_type(outputs[0].dtype());
  p.threads = kernel_threads();
  size_t next = 4;
  auto normed_dtype = in[0].dtype();
  if (fusion_.norm) {
    p.norm = true;
    p.norm_eps = fusion_.norm_eps;
    if (fusion_.norm_weight) {
      const auto& weight = in[next++];
      p.norm_weight = weight.data<void>();
      p.norm_weight_type = elem_type(weight.dtype());
      normed_dtype = mx::promote_types(normed_dtype, weight.dtype());
    }
    p.norm_type = elem_type(normed_dtype);
  }
  if (fusion_.residual) {
    const auto& residual = in[next++];
    p.residual = residual.data<void>();
    p.residual_type = elem_type(residual.dtype());
    p.product_type = elem_type(mx::promote_types(normed_dtype, in[2].dtype()));
  }
  if (p.M > max_rows_) {
    GemmPlan g;
    g.swiglu_output = fusion_.swiglu_output;
    g.scale_size = in[2].itemsize();
    g.columns = g.swiglu_output ? p.W.N / 2 : p.W.N;
    const int parts = g.swiglu_output ? 2 : 1, K = p.W.K;
    g.block = static_cast<int>(std::min<int64_t>(g.columns, std::max<int64_t>(16, GEMM_BLOCK_FLOATS / K / parts / 16 * 16)));
    enc.dispatch([p, g]() { quantized_matmul_gemm(p, g); });
  } else {
    enc.dispatch([p]() {
      give_back_kept_scratch();
      quantized_matmul_cpu(p);
    });
  }
}

void QuantizedMatmul::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[quantized_matmul] no GPU kernel; the op uses the composed path on GPU streams");
}

std::vector<mx::array> QuantizedMatmul::composed(const std::vector<mx::array>& inputs) {
  size_t next = 4;
  std::optional<mx::array> norm_weight, residual;
  if (fusion_.norm_weight) norm_weight = inputs[next++];
  if (fusion_.residual) residual = inputs[next++];
  const std::optional<float> norm_eps = fusion_.norm ? std::optional<float>(fusion_.norm_eps) : std::nullopt;
  auto product = [&](const mx::array& x) {
    return quantized_matmul_composed(x, inputs[1], inputs[2], inputs[3], group_size_, bits_, stream());
  };
  auto y = fused_composed(inputs[0], fusion_.swiglu, norm_weight, norm_eps, residual, true, product, stream());
  return {fusion_.swiglu_output ? swiglu_halves(y, stream()) : y};
}

bool QuantizedMatmul::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const QuantizedMatmul&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_ && fusion_ == o.fusion_ && max_rows_ == o.max_rows_;
}

std::vector<mx::Shape> QuantizedMatmul::output_shapes(const std::vector<mx::array>& inputs) {
  mx::Shape shape = inputs[0].shape();
  shape.back() = fusion_.swiglu_output ? inputs[1].shape(0) / 2 : inputs[1].shape(0);
  return {shape};
}

}  // namespace mlx_h2o

namespace mlx_h2o {

void DequantizeAffine::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  const auto in = prepare_contiguous(inputs, outputs, enc);
  DequantizeProblem p;
  p.W = packed_weights(in[0], in[1], in[2], group_size_, bits_);
  p.out = outputs[0].data<void>();
  p.out_type = elem_type(outputs[0].dtype());
  p.threads = kernel_threads();
  if (lookup_) {
    p.rows = in[3].data<void>();
    p.rows_unsigned = in[3].dtype() == mx::uint32;
    p.n_rows = static_cast<int64_t>(in[3].size());
  }
  enc.dispatch([p]() { dequantize_cpu(p); });
}

void DequantizeAffine::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[dequantize_affine] no GPU kernel; the op uses mx::dequantize on GPU streams");
}

std::vector<mx::array> DequantizeAffine::composed(const std::vector<mx::array>& inputs) {
  auto row = [&](int i) { return lookup_ ? mx::take(inputs[i], inputs[3], 0, stream()) : inputs[i]; };
  auto dense = mx::dequantize(row(0), row(1), row(2), group_size_, bits_, "affine", {}, std::nullopt, stream());
  return {mx::astype(dense, dtype_, stream())};
}

bool DequantizeAffine::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const DequantizeAffine&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_ && dtype_ == o.dtype_ && lookup_ == o.lookup_;
}

std::vector<mx::Shape> DequantizeAffine::output_shapes(const std::vector<mx::array>& inputs) {
  const int K = static_cast<int>(static_cast<int64_t>(inputs[0].shape(1)) * 32 / bits_);
  if (!lookup_) return {{inputs[0].shape(0), K}};
  mx::Shape shape = inputs[3].shape();
  shape.push_back(K);
  return {shape};
}

}  // namespace mlx_h2o
