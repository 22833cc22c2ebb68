#include "uninitialized.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <unistd.h>
#if defined(__linux__)
#include <sys/mman.h>
#define MLX_H2O_CAN_RELEASE_PAGES 1
#else
// macOS: CPU arrays live in Metal buffers there, and its madvise has no eager "drop these pages"
// (MADV_DONTNEED is a hint, MADV_FREE reclaims only under memory pressure). See the README.
#define MLX_H2O_CAN_RELEASE_PAGES 0
#endif

#include "mlx/allocator.h"
#include "mlx/transforms.h"

namespace mlx_h2o {

namespace {

uintptr_t round_up(uintptr_t x, size_t page) { return (x + page - 1) / page * page; }
uintptr_t round_down(uintptr_t x, size_t page) { return x / page * page; }

// Hand the whole pages inside [begin, end) back to the OS; return the bytes released. Never
// touches a byte outside the range: partial pages at either end are left alone.
size_t discard_whole_pages(char* begin, char* end) {
#if MLX_H2O_CAN_RELEASE_PAGES
  const size_t page = page_size();
  uintptr_t first = round_up(reinterpret_cast<uintptr_t>(begin), page);
  uintptr_t last = round_down(reinterpret_cast<uintptr_t>(end), page);
  if (last <= first) return 0;
  // Private anonymous memory (what MLX's CPU allocator hands out) reads back as zeros afterwards.
  if (madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED) != 0) {
    throw std::runtime_error(std::string("[release_pages] madvise failed: ") + std::strerror(errno));
  }
  return last - first;
#else
  (void)begin;
  (void)end;
  return 0;
#endif
}

// Keep [begin, end) in small pages: a transparent huge page commits 2 MiB at the first write into
// it, which defeats committing page by page. The range may inherit MADV_HUGEPAGE from an earlier
// user of the same heap memory (NumPy marks its large buffers so), which made a reservation commit
// a whole huge page after a few rows were written. Best effort: kernels without THP say EINVAL.
void avoid_huge_pages(char* begin, char* end) {
#if MLX_H2O_CAN_RELEASE_PAGES
  const size_t page = page_size();
  uintptr_t first = round_up(reinterpret_cast<uintptr_t>(begin), page);
  uintptr_t last = round_down(reinterpret_cast<uintptr_t>(end), page);
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_NOHUGEPAGE);
#else
  (void)begin;
  (void)end;
#endif
}

// The start of what allocator::malloc returned. MLX 0.32.1 returns the Buffer itself; later
// releases wrap it in an owning allocator::Data (`.buffer()`). Overloads pick whichever exists.
inline void* raw_ptr(mx::allocator::Buffer buffer) { return buffer.raw_ptr(); }
template <class Data>
auto raw_ptr(const Data& data) -> decltype(data.buffer().raw_ptr()) {
  return data.buffer().raw_ptr();
}

}  // namespace

size_t page_size() {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return page;
}

mx::array uninitialized(const mx::Shape& shape, mx::Dtype dtype, mx::StreamOrDevice s) {
  // Checked before anything is allocated: a negative or overflowing size must not reach malloc.
  size_t nbytes = mx::size_of(dtype);
  for (auto d : shape) {
    if (d < 0) {
      std::ostringstream msg;
      msg << "[uninitialized] shape must be non-negative, got a dimension of " << d << ".";
      throw std::invalid_argument(msg.str());
    }
    if (__builtin_mul_overflow(nbytes, static_cast<size_t>(d), &nbytes) ||
        nbytes > static_cast<size_t>(std::numeric_limits<int64_t>::max()) - page_size()) {
      throw std::invalid_argument("[uninitialized] the array's size in bytes overflows.");
    }
  }
  return mx::array(shape, dtype, std::make_shared<Uninitialized>(mx::to_stream(s)), {});
}

void Uninitialized::eval_cpu(const std::vector<mx::array>&, mx::array& out) {
  const size_t nbytes = out.nbytes();
  const size_t page = page_size();
  if (nbytes < page) {
    out.set_data(mx::allocator::malloc(nbytes));
    return;
  }
  // One spare page so the data can start on a page boundary: then the pages a writer commits
  // are exactly the pages its bytes span, and released ranges line up with element ranges.
  auto data = mx::allocator::malloc(nbytes + page);
  char* raw = static_cast<char*>(raw_ptr(data));
  if (raw == nullptr) {
    std::ostringstream msg;
    msg << "[uninitialized] could not allocate " << nbytes + page << " bytes.";
    throw std::runtime_error(msg.str());
  }
  // The allocator may recycle a buffer (its cache, or a reused heap chunk) whose pages are
  // already committed: give them back so untouched pages cost nothing, whatever it handed out.
  discard_whole_pages(raw, raw + nbytes + page);
  avoid_huge_pages(raw, raw + nbytes + page);
  const size_t offset_bytes = round_up(reinterpret_cast<uintptr_t>(raw), page) -
      reinterpret_cast<uintptr_t>(raw);
  out.set_data(std::move(data));
  if (offset_bytes != 0) {
    // MLX's allocator returns 8-byte aligned memory and pages are multiples of 8 bytes, so the
    // offset is a whole number of elements for every dtype up to 8 bytes wide.
    const size_t itemsize = out.itemsize();
    if (offset_bytes % itemsize != 0) {
      throw std::runtime_error("[uninitialized] allocator returned memory misaligned for the dtype.");
    }
    mx::array whole = out;  // same descriptor: re-point it at the page-aligned start
    out.copy_shared_buffer(whole, mx::Strides(out.strides()), out.flags(), out.size(),
                           static_cast<int64_t>(offset_bytes / itemsize));
  }
}

void Uninitialized::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[uninitialized] GPU streams are not supported; use a CPU stream.");
}

size_t release_pages(mx::array& a, int axis, int64_t start) {
  const int ndim = static_cast<int>(a.ndim());
  if (ndim == 0) throw std::invalid_argument("[release_pages] the array must have at least one dimension.");
  if (axis < -ndim || axis >= ndim) {
    std::ostringstream msg;
    msg << "[release_pages] axis must be in [" << -ndim << ", " << ndim << "), got " << axis << ".";
    throw std::invalid_argument(msg.str());
  }
  if (axis < 0) axis += ndim;
  if (start < 0 || start > a.shape(axis)) {
    std::ostringstream msg;
    msg << "[release_pages] start must be in [0, " << a.shape(axis) << "] (the size of axis " << axis
        << "), got " << start << ".";
    throw std::invalid_argument(msg.str());
  }
  a.eval();
  if (!a.flags().row_contiguous || a.data_size() != a.size()) {
    throw std::invalid_argument("[release_pages] the array must be row-contiguous and own a dense buffer.");
  }
  // Donatable = no other array shares the buffer or waits to read it: the same condition under
  // which MLX itself may overwrite the buffer. Otherwise releasing could change what they see.
  if (!a.is_donatable() || a.size() == 0) return 0;

  size_t inner = 1;  // elements per step along `axis`
  for (int i = axis + 1; i < ndim; ++i) inner *= a.shape(i);
  const size_t row = inner * a.shape(axis);  // elements per index of the leading axes
  const size_t outer = a.size() / row;
  const size_t itemsize = a.itemsize();
  char* base = a.data<char>();

  // The dead ranges are [o * row + start * inner, (o + 1) * row) for each leading index o;
  // adjacent ones (start == 0) are merged so a full release is one call.
  size_t released = 0;
  char* run_begin = nullptr;
  char* run_end = nullptr;
  for (size_t o = 0; o < outer; ++o) {
    char* begin = base + (o * row + static_cast<size_t>(start) * inner) * itemsize;
    char* end = base + (o + 1) * row * itemsize;
    if (run_end == begin) {
      run_end = end;
      continue;
    }
    if (run_begin) released += discard_whole_pages(run_begin, run_end);
    run_begin = begin;
    run_end = end;
  }
  if (run_begin) released += discard_whole_pages(run_begin, run_end);
  return released;
}

size_t collapse_into_huge_pages(const std::vector<mx::array>& arrays) {
  mx::eval(arrays);
#if MLX_H2O_CAN_RELEASE_PAGES
  constexpr uintptr_t huge = uintptr_t(2) << 20;
  constexpr int madv_collapse = 25;  // <linux/mman.h>, Linux 6.1; older headers lack the name
  // Each array's bytes as [begin, end), merged where they overlap (views of one buffer).
  std::vector<std::pair<uintptr_t, uintptr_t>> spans;
  for (const auto& a : arrays) {
    const size_t nbytes = a.data_size() * a.itemsize();
    if (nbytes == 0) continue;
    const auto begin = reinterpret_cast<uintptr_t>(a.data<char>());
    spans.emplace_back(begin, begin + nbytes);
  }
  std::sort(spans.begin(), spans.end());
  // Bytes of the arrays in each 2 MiB block. Only blocks they fill at least half of are collapsed:
  // collapsing commits the whole block, so a block mostly of other (or unwritten) memory could
  // cost more resident memory than its arrays.
  std::vector<std::pair<uintptr_t, size_t>> filled;  // (block, bytes), blocks ascending
  uintptr_t covered_to = 0;
  for (auto [begin, end] : spans) {
    begin = std::max(begin, covered_to);
    if (begin >= end) continue;
    covered_to = end;
    for (uintptr_t block = round_down(begin, huge); block < end; block += huge) {
      const size_t bytes = std::min(end, block + huge) - std::max(begin, block);
      if (!filled.empty() && filled.back().first == block) {
        filled.back().second += bytes;
      } else {
        filled.emplace_back(block, bytes);
      }
    }
  }
  size_t collapsed = 0;
  for (const auto& [block, bytes] : filled) {
    if (bytes < huge / 2) continue;
    void* p = reinterpret_cast<void*>(block);
    // Each block alone: one that is not all mapped, or not anonymous memory, fails by itself
    // (ENOMEM / EINVAL) and is left as it is.
    if (madvise(p, huge, MADV_HUGEPAGE) != 0) continue;
    if (madvise(p, huge, madv_collapse) == 0) collapsed += huge;
  }
  return collapsed;
#else
  return 0;
#endif
}

}  // namespace mlx_h2o
