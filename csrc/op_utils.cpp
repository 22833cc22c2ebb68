#include "op_utils.h"

#include <cstring>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "mlx/allocator.h"

namespace mlx_h2o {

std::string shape_str(const mx::Shape& s) {
  std::ostringstream os;
  os << "(";
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << (s.size() == 1 ? ",)" : ")");
  return os.str();
}

void fail(const std::string& msg) { throw std::invalid_argument(msg); }

bool is_float_dtype(mx::Dtype t) { return t == mx::float32 || t == mx::float16 || t == mx::bfloat16; }

ElemType elem_type(mx::Dtype t) {
  if (t == mx::float32) return ElemType::float32;
  if (t == mx::float16) return ElemType::float16;
  if (t == mx::bfloat16) return ElemType::bfloat16;
  if (t == mx::bool_) return ElemType::boolean;
  throw std::invalid_argument("[mlx_h2o] unsupported dtype");
}

bool needs_copy(const mx::array& a) { return a.ndim() > 0 && a.shape().back() > 1 && a.strides().back() != 1; }

mx::array contiguous_copy(const mx::array& a, mx::cpu::CommandEncoder& enc) {
  mx::array out(a.shape(), a.dtype(), nullptr, {});
  out.set_data(mx::allocator::malloc(out.nbytes()));
  enc.add_temporary(out);
  enc.dispatch([src = static_cast<const char*>(a.data<void>()), dst = static_cast<char*>(out.data<void>()),
                es = a.itemsize(), shape = a.shape(), strides = a.strides()]() {
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

std::vector<mx::array> prepare_contiguous(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs,
                                          mx::cpu::CommandEncoder& enc) {
  std::vector<mx::array> in = inputs;
  for (auto& a : in) {
    if (!a.flags().row_contiguous) a = contiguous_copy(a, enc);
    enc.set_input_array(a);
  }
  for (auto& o : outputs) {
    o.set_data(mx::allocator::malloc(o.nbytes()));
    enc.set_output_array(o);
  }
  return in;
}

}  // namespace mlx_h2o
