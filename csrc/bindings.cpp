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
  m.def("page_size", &mlx_h2o::page_size, "Bytes per page of the OS's virtual memory.");
}
