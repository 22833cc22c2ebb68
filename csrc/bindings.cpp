// Python bindings for the mlx-h2o MLX extension ops.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "mlx/ops.h"
#include "mlx/version.h"

#include "accumulate_prefix.h"
#include "attention_with_scores.h"
#include "kernels/isa.h"
#include "exp_ops.h"
#include "norm_rope.h"
#include "parallel.h"
#include "kv_rows.h"
#include "quantized_matmul.h"
#include "take_rows.h"
#include "top_rows.h"
#include "uninitialized.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace nb::literals;

namespace {

// (k arrays, k bits, k group size, k rows, v arrays, v bits, v group size, v rows); one array = dense,
// rows -1 = all the arrays' rows (mlx_h2o::KVInput).
using SegmentTuple = std::tuple<std::vector<mx::array>, int, int, int, std::vector<mx::array>, int, int, int>;

std::vector<mlx_h2o::SegmentInput> to_segments(const std::vector<SegmentTuple>& segments) {
  std::vector<mlx_h2o::SegmentInput> out;
  for (const auto& [k, kb, kg, kr, v, vb, vg, vr] : segments)
    out.push_back({mlx_h2o::KVInput{k, kb, kg, kr}, mlx_h2o::KVInput{v, vb, vg, vr}});
  return out;
}

}  // namespace

NB_MODULE(_ext, m) {
  m.doc() = "mlx-h2o C++ kernels (MLX extension ops)";
  m.attr("built_with_mlx") = MLX_H2O_BUILT_WITH_MLX;
  m.def("linked_mlx_version", []() { return std::string(mlx::core::version()); },
        "Version string of the libmlx this extension is running against.");
  m.def("kernel_isa", []() { return std::string(mlx_h2o::kernel_isa_name()); },
        "The instruction-set variant of the CPU kernels in use on this machine.");
  m.def("kernel_threads", &mlx_h2o::kernel_threads, "Threads the CPU kernels use (MLX_H2O_NUM_THREADS).");

  m.def(
      "uninitialized",
      [](const std::vector<int>& shape, mx::Dtype dtype, mx::StreamOrDevice s) {
        // mx::Shape is a SmallVector, which has no nanobind caster outside MLX's own bindings.
        return mlx_h2o::uninitialized(mx::Shape(shape.begin(), shape.end()), dtype, s);
      },
      "shape"_a, "dtype"_a, nb::kw_only(), "stream"_a = nb::none(),
      "Allocate an array without initialising it. Arrays of at least one page start on a page\n"
      "boundary and hold no committed pages until written (the OS commits each page on its first\n"
      "write), even when MLX's allocator recycles a buffer.");

  m.def(
      "release_pages",
      // By reference: the caller's own array, so its reference count says whether anyone else
      // can observe the buffer.
      [](mx::array& a, int64_t start, int axis) { return mlx_h2o::release_pages(a, axis, start); },
      "a"_a, "start"_a, nb::kw_only(), "axis"_a = -2,
      "Give the OS back the whole pages of a[..., start:, ...] (start along `axis`) and return the\n"
      "number of bytes released; those elements' contents become unspecified (zero on Linux).\n"
      "`a` is evaluated first and must be row-contiguous. Releases nothing (returns 0) while another\n"
      "array shares the buffer or waits to read it, or where the OS cannot (not Linux).");
  m.def("collapse_into_huge_pages", &mlx_h2o::collapse_into_huge_pages, "arrays"_a,
        "Back the 2 MiB blocks that the arrays' buffers fill at least half of with transparent huge\n"
        "pages now (Linux 6.1+: madvise MADV_HUGEPAGE then MADV_COLLAPSE); return the bytes collapsed.\n"
        "For long-lived arrays read in full on every call, such as a model's weights. Contents and\n"
        "addresses do not change; 0 where the OS cannot.");
  m.def("page_size", &mlx_h2o::page_size, "Bytes per page of the OS's virtual memory.");
  m.def("accumulate_prefix", &mlx_h2o::accumulate_prefix, "acc"_a, "x"_a, "alpha"_a, "beta"_a, "held"_a,
        "stream"_a = nb::none(),
        "acc (..., C) float32 with its first N entries replaced by alpha * acc + beta * x (x: (..., N)),\n"
        "entries at or past `held` read as 0; one pass, in place when MLX can donate acc's buffer.");
  m.def("accumulate_prefix_along", &mlx_h2o::accumulate_prefix_along, "acc"_a, "x"_a, "alpha"_a, "beta"_a, "held"_a,
        "along"_a, "stream"_a = nb::none(),
        "accumulate_prefix, and `along` passed through: [the updated column, along], outputs of one primitive,\n"
        "so evaluating `along`'s output evaluates the column's (the column is then a copy, not updated in place).");
  m.def("take_rows", &mlx_h2o::take_rows, "arrays"_a, "idx"_a, "stream"_a = nb::none(),
        "For each array (B, H, C, ...), its rows idx (B, H, K) (int32 / uint32) per (batch, head): a list of (B, H, K, ...)\n"
        "arrays, one primitive for all (an index outside [0, C) gives a row of zeros).");
  m.def("top_rows", &mlx_h2o::top_rows, "key"_a, "count"_a, "capacity"_a = -1, "stream"_a = nb::none(),
        "key (..., P) float32 -> (..., capacity) int32: per row the indices of its `count` largest keys (ties: the\n"
        "lower index; NaN ranks as -inf), ascending, then zeros up to `capacity` (-1: count). One primitive.");
  m.def("rotate_rows", &mlx_h2o::rotate_rows, "x"_a, "rotation"_a, "dtype"_a, "stream"_a = nb::none(),
        "x (..., D) @ rotation (D, D), each output summed in float64 and rounded once to dtype.");
  m.def("quantize_rows_into", &mlx_h2o::quantize_rows_into, "packed"_a, "scales"_a, "biases"_a, "x"_a, "start"_a,
        "rotation"_a.none(), "bits"_a, "group_size"_a, "center"_a.none() = nb::none(), "stream"_a = nb::none(),
        "The packed buffers (packed, scales, biases) with rows [start, start + n) replaced by mx.quantize of\n"
        "y = x.astype(T) (T: the scales' dtype), (y - center).astype(T) when centred, rotated by rotation in T;\n"
        "one pass, in place when the buffers are large and MLX can donate them.");


  m.def(
      "attention_with_scores",
      [](const mx::array& q, const std::vector<SegmentTuple>& segments, float scale, const std::string& mask_mode,
         const std::optional<mx::array>& mask, const std::string& scores, const std::optional<mx::array>& sinks,
         bool composed, const std::optional<mx::array>& q_rotation, const std::optional<mx::array>& out_rotation,
         const std::optional<std::tuple<mx::array, float, float, int>>& score_column, mx::StreamOrDevice s) {
        auto segs = to_segments(segments);
        std::optional<mlx_h2o::ScoreColumn> column;
        if (score_column) {
          const auto& [acc, alpha, beta, held] = *score_column;
          column = mlx_h2o::ScoreColumn{acc, alpha, beta, held};
        }
        return composed ? mlx_h2o::attention_with_scores_composed(q, segs, scale, mask_mode, mask, scores, sinks,
                                                                  q_rotation, out_rotation, column, s)
                        : mlx_h2o::attention_with_scores(q, segs, scale, mask_mode, mask, scores, sinks, q_rotation,
                                                         out_rotation, column, s);
      },
      "q"_a, "segments"_a, "scale"_a, "mask_mode"_a, "mask"_a.none(), "scores"_a, "sinks"_a.none(), "composed"_a,
      "q_rotation"_a.none() = nb::none(), "out_rotation"_a.none() = nb::none(), "score_column"_a.none() = nb::none(),
      "stream"_a = nb::none(), "Fused attention over K/V segments (Python API: mlx_h2o.attention_with_scores and the\n"
      "single-segment mlx_h2o.scaled_dot_product_attention_with_scores / quantized_... built on it); with\n"
      "score_column (acc, alpha, beta, held), also acc with the mass folded in as accumulate_prefix does.");

  m.def("quantized_matmul", &mlx_h2o::quantized_matmul, "x"_a, "w"_a, "scales"_a, "biases"_a, "group_size"_a, "bits"_a,
        "max_rows"_a = -1, "norm_weight"_a.none() = nb::none(), "norm_eps"_a.none() = nb::none(),
        "residual"_a.none() = nb::none(), "swiglu"_a = false, "swiglu_output"_a = false, "stream"_a = nb::none(),
        "x @ W^T over packed affine weights (Python API: mlx_h2o.quantized_matmul); with norm_eps, of\n"
        "rms_norm(x, norm_weight, norm_eps); with swiglu, of swiglu_halves(x); with residual, residual +\n"
        "the product; with swiglu_output, swiglu_halves of the product: one primitive.");
  m.def("quantized_matmul_composed", &mlx_h2o::quantized_matmul_composed, "x"_a, "w"_a, "scales"_a, "biases"_a,
        "group_size"_a, "bits"_a, "stream"_a = nb::none(), "Dequantize + matmul: the definition of quantized_matmul.");
  m.def("dequantize_affine", &mlx_h2o::dequantize_affine, "w"_a, "scales"_a, "biases"_a, "group_size"_a, "bits"_a,
        "dtype"_a, "stream"_a = nb::none(), "Packed affine weights as a dense array (one vectorized pass on the CPU).");
  m.def("quantized_embedding", &mlx_h2o::quantized_embedding, "indices"_a, "w"_a, "scales"_a, "biases"_a,
        "group_size"_a, "bits"_a, "stream"_a = nb::none(),
        "Rows of packed affine weights at int32 / uint32 indices, dequantized (nn.QuantizedEmbedding's call):\n"
        "one CPU kernel; an index outside the rows gives a row of NaN.");
  m.def("rms_norm", &mlx_h2o::rms_norm, "x"_a, "weight"_a.none(), "eps"_a, "stream"_a = nb::none(),
        "mx.fast.rms_norm as one CPU kernel (Python API: mlx_h2o.rms_norm).");
  m.def("rope", &mlx_h2o::rope, "x"_a, "dims"_a, "traditional"_a, "base"_a, "scale"_a, "offset"_a,
        "stream"_a = nb::none(), "mx.fast.rope with an integer offset as one CPU kernel (Python API: mlx_h2o.rope).");
  m.def("split_heads_rope", &mlx_h2o::split_heads_rope, "x"_a, "heads"_a, "head_dim"_a, "rotated"_a, "dims"_a,
        "traditional"_a, "base"_a, "scale"_a, "offset"_a, "dtypes"_a = std::vector<mx::Dtype>{}, "stream"_a = nb::none(),
        "A packed (B, L, sum(heads) * head_dim) projection as one (B, heads[i], L, head_dim) array per group,\n"
        "the first `rotated` groups through rope, each in its dtype (dtypes; empty: x's): one CPU kernel.");
  m.def("swiglu", &mlx_h2o::swiglu, "gate"_a, "up"_a, "stream"_a = nb::none(),
        "gate * sigmoid(gate) * up (mlx-lm's swiglu) as one CPU kernel (Python API: mlx_h2o.swiglu).");
  m.def("swiglu_halves", &mlx_h2o::swiglu_halves, "x"_a, "stream"_a = nb::none(),
        "swiglu of the halves of x's last axis, gate then up (a packed gate/up product), as one CPU kernel.");
  m.def("logsumexp_last_axis", &mlx_h2o::logsumexp_last_axis, "x"_a, "stream"_a = nb::none(),
        "mx.logsumexp(x, axis=-1) as one CPU kernel (the fork's MLX runs it for mx.logsumexp).");
  m.def("attention_int8_queries", &mlx_h2o::attention_int8_queries,
        "Whether attention ops built now round queries to int8 for packed 4-/8-bit keys.");
  m.def("set_attention_int8_queries", &mlx_h2o::set_attention_int8_queries, "enabled"_a,
        "Integer Q K^T against packed 4-/8-bit keys (True, the default) or float32 queries (False).");
}
