// Reserve memory that costs address space, not RSS, until it is written; give pages back later.
//
// `uninitialized` allocates an array without writing it. MLX's CPU allocator gets large buffers
// from malloc (fresh mmap'd pages, uncommitted), but it also recycles freed buffers from its own
// buffer cache, and glibc recycles heap chunks: both hand back pages that are already committed
// and dirty. So the op returns the array's whole pages to the OS (madvise(MADV_DONTNEED) on Linux)
// right after allocating: whatever the allocator handed out, untouched pages are uncommitted, and
// the OS commits each page on its first write. The data starts on a page boundary, so a buffer
// written front to back commits exactly the pages its written bytes span.
//
// The memory stays owned by MLX's allocator, which is what lets MLX donate the buffer: a
// slice_update into it then writes in place (an array wrapping external memory is never donated,
// so every update would copy the whole buffer).
//
// `release_pages` gives back the pages of a[..., start:, ...] (along one axis) once those elements
// are dead, e.g. after a KV cache is trimmed. It acts only when no other array can observe the
// buffer, i.e. when MLX itself would be allowed to overwrite it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mlx_h2o {

namespace mx = mlx::core;

/** Allocate an array of `shape` and `dtype` without initialising its contents. Arrays of at
 * least one page start on a page boundary and hold no committed pages until written. */
mx::array uninitialized(const mx::Shape& shape, mx::Dtype dtype, mx::StreamOrDevice s = {});

/** Give the OS back the whole pages of `a[..., start:, ...]` (`start` along `axis`); return the
 * number of bytes released. Those elements' contents become unspecified (zero on Linux).
 *
 * `a` is evaluated first. It must be row-contiguous and own a dense buffer. Nothing is released
 * (the result is 0) while another array shares the buffer or waits to read it (`a` is not
 * donatable), or where the platform cannot release pages (not Linux). */
size_t release_pages(mx::array& a, int axis, int64_t start);

/** Back the 2 MiB-aligned blocks that `arrays`' buffers fill at least half of with transparent huge
 * pages, now (Linux: madvise MADV_HUGEPAGE, then MADV_COLLAPSE, kernel 6.1+); return the bytes of
 * blocks collapsed. For long-lived arrays read in full on every call, a model's weights: a decode step
 * streams them all, and on 4 KiB pages a translation miss every 4 KiB stalls the stream (measured:
 * docs/cpu-decode.md, "Clean upper registers after every kernel, and the weights on huge pages").
 * The arrays are evaluated first; their contents and
 * addresses do not change. Returns 0 where the OS cannot (not Linux, THP off, an older kernel keeps
 * only the hint). The blocks may hold other memory of the process besides the arrays. */
size_t collapse_into_huge_pages(const std::vector<mx::array>& arrays);

/** Bytes per page of the OS's virtual memory. */
size_t page_size();

class Uninitialized : public mx::UnaryPrimitive {
 public:
  explicit Uninitialized(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override { return "Uninitialized"; }
  // Never equivalent to another node: two reservations must not be merged by graph simplification.
  bool is_equivalent(const mx::Primitive& other) const override { return false; }
};

}  // namespace mlx_h2o
