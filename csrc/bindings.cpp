// Python bindings for the mlx-h2o MLX extension ops.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "mlx/ops.h"

#include "mlx/version.h"

#include "uninitialized.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace nb::literals;

NB_MODULE(_ext, m) {
  m.doc() = "mlx-h2o C++ kernels (MLX extension ops)";
  m.attr("built_with_mlx") = MLX_H2O_BUILT_WITH_MLX;
  m.def("linked_mlx_version", []() { return std::string(mlx::core::version()); },
        "Version string of the libmlx this extension is running against.");

  m.def(
      "uninitialized",
      [](const std::vector<int>& shape, mx::Dtype dtype, mx::StreamOrDevice s) {
        // mx::Shape is a SmallVector, which has no nanobind caster outside MLX's own bindings.
        return mlx_h2o::uninitialized(mx::Shape(shape.begin(), shape.end()), dtype, s);
      },
      "shape"_a, "dtype"_a, nb::kw_only(), "stream"_a = nb::none(),
      "Allocate an array without initialising it (pages are committed on first write).");
}
