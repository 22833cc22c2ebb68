// Python bindings for the mlx-h2o MLX extension ops.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "mlx/ops.h"
#include "mlx/version.h"

#include "kernels/attention_problem.h"
#include "parallel.h"
#include "scaled_dot_product_attention_with_scores.h"
#include "uninitialized.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace nb::literals;

NB_MODULE(_ext, m) {
  m.doc() = "mlx-h2o C++ kernels (MLX extension ops)";
  m.attr("built_with_mlx") = MLX_H2O_BUILT_WITH_MLX;
  m.def("linked_mlx_version", []() { return std::string(mlx::core::version()); },
        "Version string of the libmlx this extension is running against.");
  m.def("kernel_isa", []() { return std::string(mlx_h2o::attention_cpu_isa()); },
        "The instruction-set variant of the CPU kernels in use on this machine.");
  m.def("kernel_threads", &mlx_h2o::kernel_threads, "Threads the CPU kernels use (MLX_H2O_NUM_THREADS).");

  m.def(
      "uninitialized",
      [](const std::vector<int>& shape, mx::Dtype dtype, mx::StreamOrDevice s) {
        // mx::Shape is a SmallVector, which has no nanobind caster outside MLX's own bindings.
        return mlx_h2o::uninitialized(mx::Shape(shape.begin(), shape.end()), dtype, s);
      },
      "shape"_a, "dtype"_a, nb::kw_only(), "stream"_a = nb::none(),
      "Allocate an array without initialising it (pages are committed on first write).");

  m.def("scaled_dot_product_attention_with_scores", &mlx_h2o::scaled_dot_product_attention_with_scores, "q"_a,
        "k"_a, "v"_a, "scale"_a, "mask_mode"_a, "mask"_a.none(), "scores"_a, "sinks"_a.none(),
        "stream"_a = nb::none(),
        "Fused attention + scores (see mlx_h2o.scaled_dot_product_attention_with_scores for the Python API).");
  m.def("attention_with_scores_composed", &mlx_h2o::attention_with_scores_composed, "q"_a, "k"_a, "v"_a, "scale"_a,
        "mask_mode"_a, "mask"_a.none(), "scores"_a, "sinks"_a.none(), "stream"_a = nb::none(),
        "The same computation from stock MLX ops (the fallback off the CPU).");
}
