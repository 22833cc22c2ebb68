// K/V row access for the attention kernel. A loader turns (batch, kv head, position within its
// segment) into a row handle and reads 8 floats from it at a column offset (a multiple of 8); the
// attention loops are written once against this interface and instantiated per storage format by
// with_loader, the one place the formats are enumerated. Per-ISA kernel source (no include guard).

namespace mlx_h2o {
namespace MLX_H2O_ISA_NS {

// Loader interface:
//   Row row(b, h, n)                 handle of a row of the segment
//   rows(b, h, n0, tn, out)          handles of tn consecutive rows
//   Group group(row, d)              (scale, bias) of the group holding column d (empty for dense
//                                    rows); groups are multiples of 32 columns
//   v8f load(row, group, d)          8 floats at column d (d a multiple of 8, in `group`)
//   float load1(row, d)              one float (dense rows only: head dims not a multiple of 8)
struct NoGroup {};

template <class Elem>
struct DenseLoader {
  using S = typename Elem::Storage;
  using Row = const S*;
  using Group = NoGroup;
  const S* base;
  int64_t sb, sh, sn;
  explicit DenseLoader(const KVSource& src)
      : base(static_cast<const S*>(src.dense.data)), sb(src.dense.stride[0]), sh(src.dense.stride[1]), sn(src.dense.stride[2]) {}
  Row row(int b, int h, int n) const { return base + b * sb + h * sh + n * sn; }
  void rows(int b, int h, int n0, int tn, Row* out) const {
    Row r = row(b, h, n0);
    for (int t = 0; t < tn; ++t, r += sn) out[t] = r;
  }
  static Group group(Row, int) { return {}; }
  static v8f load(Row r, Group, int d) { return Elem::load8(r + d); }
  static float load1(Row r, int d) { return Elem::load1(r + d); }
};

// MLX affine quantization: value = scale * q + bias per group; 8 consecutive BITS-bit values occupy
// exactly BITS bytes of the row's little-endian bit stream, so any 8-aligned chunk is one small load.
template <int BITS, class ScaleElem>
struct QuantLoader {
  static constexpr int bits = BITS;
  using Scale = ScaleElem;
  using S = typename ScaleElem::Storage;
  struct Row {
    const uint8_t* w;
    const S* scale;
    const S* bias;
  };
  struct Group {
    v8f scale, bias;
  };
  const uint8_t* w;
  const S* sc;
  const S* bi;
  int64_t wb, wh, wn, sb, sh, sn, bb, bh, bn;  // strides: packed in bytes, scales / biases in elements
  int group_size, group_shift;

  explicit QuantLoader(const KVSource& src)
      : w(static_cast<const uint8_t*>(src.packed.data)),
        sc(static_cast<const S*>(src.scales.data)),
        bi(static_cast<const S*>(src.biases.data)),
        wb(4 * src.packed.stride[0]), wh(4 * src.packed.stride[1]), wn(4 * src.packed.stride[2]),
        sb(src.scales.stride[0]), sh(src.scales.stride[1]), sn(src.scales.stride[2]),
        bb(src.biases.stride[0]), bh(src.biases.stride[1]), bn(src.biases.stride[2]),
        group_size(src.group_size), group_shift(__builtin_ctz(static_cast<unsigned>(src.group_size))) {}

  Row row(int b, int h, int n) const {
    return Row{w + b * wb + h * wh + n * wn, sc + b * sb + h * sh + n * sn, bi + b * bb + h * bh + n * bn};
  }
  void rows(int b, int h, int n0, int tn, Row* out) const {
    Row r = row(b, h, n0);
    for (int t = 0; t < tn; ++t, r.w += wn, r.scale += sn, r.bias += bn) out[t] = r;
  }
  Group group(const Row& r, int d) const {
    const int g = d >> group_shift;
    return Group{splat(ScaleElem::load1(r.scale + g)), splat(ScaleElem::load1(r.bias + g))};
  }
  // The stored integers of 8 columns as floats (value = scale * raw + bias), and the group's scalars:
  // P V factors the scale and bias out of its sum over keys.
  static v8f load_raw(const Row& r, int d) { return unpack8<BITS>(r.w + (static_cast<unsigned>(d) >> 3) * BITS); }
  float scale_of(const Row& r, int d) const { return ScaleElem::load1(r.scale + (d >> group_shift)); }
  float bias_of(const Row& r, int d) const { return ScaleElem::load1(r.bias + (d >> group_shift)); }
  static v8f load(const Row& r, const Group& gp, int d) {
    const v8f x = unpack8<BITS>(r.w + (static_cast<unsigned>(d) >> 3) * BITS);
    return x * gp.scale + gp.bias;
  }
  static float load1(const Row&, int) { return 0.0f; }  // unused: quantized head dims are multiples of 32
};

// Runs f(loader) with the loader for `src`'s storage format: the one place formats are enumerated.
template <class F>
static void with_loader(const KVSource& src, F&& f) {
  if (!src.quantized) {
    with_float_elem(src.dense.type, [&](auto elem) { f(DenseLoader<decltype(elem)>(src)); });
    return;
  }
  auto by_bits = [&](auto scale_elem) {
    using SE = decltype(scale_elem);
    switch (src.bits) {
      case 2: f(QuantLoader<2, SE>(src)); return;
      case 3: f(QuantLoader<3, SE>(src)); return;
      case 4: f(QuantLoader<4, SE>(src)); return;
      case 5: f(QuantLoader<5, SE>(src)); return;
      case 6: f(QuantLoader<6, SE>(src)); return;
      case 8: f(QuantLoader<8, SE>(src)); return;
      default: return;  // rejected by the op
    }
  };
  with_float_elem(src.scales.type, by_bits);
}

}  // namespace MLX_H2O_ISA_NS
}  // namespace mlx_h2o
