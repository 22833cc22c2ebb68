"""Which implementation runs mlx-h2o's attention ops: the C++ extension (`_ext`) or the same ops inside
MLX (`mx.fast.scaled_dot_product_attention_with_scores` and `mx.fast.quantized_...`), as an MLX built
from patches/mlx by scripts/build_wheels.sh provides them (docs/mlx-fork.md).

The switch: the environment variable MLX_H2O_OPS, read at the first op call,
  ext   the extension (default);
  mlx   MLX's ops (an error if this MLX lacks them);
  auto  MLX's ops when this MLX has them, else the extension;
and `set_implementation()` at run time (tests and benchmarks compare both in one process).

mx.fast's ops take one K/V pair, where the extension's op takes segments (storage tiers kept apart).
With "mlx", a call over several segments concatenates them first: packed segments of one format stay
packed, a mix of formats is dequantized (exactly, with float32 scales) to one dense K or V. The
composed reference (`composed=True`) always comes from the extension. The extension's int8-query
option (packed 4-/8-bit keys dotted with queries rounded to int8) has no counterpart in mx.fast, whose
quantized op keeps float32 queries; `int8_queries()` says which applies.
"""

import os

import mlx.core as mx

from ._native import _ext

IMPLEMENTATIONS = ("ext", "mlx", "auto")
FAST_OPS = ("scaled_dot_product_attention_with_scores", "quantized_scaled_dot_product_attention_with_scores")

_current = None


def mlx_has_ops() -> bool:
    """Whether this MLX has the attention ops in mx.fast (an MLX built with patches/mlx)."""
    return all(hasattr(mx.fast, name) for name in FAST_OPS)


def _resolve(choice) -> str:
    if choice not in IMPLEMENTATIONS:
        raise ValueError(f"MLX_H2O_OPS must be one of {IMPLEMENTATIONS}, got {choice!r}")
    if choice == "auto":
        return "mlx" if mlx_has_ops() else "ext"
    if choice == "mlx" and not mlx_has_ops():
        raise ValueError(
            f"MLX_H2O_OPS='mlx' needs an MLX built with mlx-h2o's patches (scripts/build_wheels.sh, "
            f"docs/mlx-fork.md); mx.fast of MLX {mx.__version__} has no {FAST_OPS[0]}"
        )
    return choice


def implementation() -> str:
    """The implementation in use: "ext" or "mlx"."""
    global _current
    if _current is None:
        _current = _resolve(os.environ.get("MLX_H2O_OPS", "ext"))
    return _current


def set_implementation(choice: str) -> str:
    """Switch to "ext", "mlx" or "auto"; returns the implementation that was in use."""
    global _current
    previous = implementation()
    _current = _resolve(choice)
    return previous


def int8_queries() -> bool:
    """Whether the implementation in use dots packed 4-/8-bit keys with int8-rounded queries: the
    extension's option (`_ext.set_attention_int8_queries`, on by default). mx.fast's quantized op
    always takes float32 queries: it is defined as attention on the dequantized K/V."""
    return implementation() == "ext" and _ext.attention_int8_queries()


def _dense(packed, bits, group_size):
    w, scales, biases = packed
    # float32 scales: MLX's dequantize computes in the scales' dtype, which would round through f16.
    return mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32), group_size, bits)


def _merge(sources):
    """One K (or V) from the segments' (arrays, bits, group_size) sources: (arrays, bits, group_size)."""
    if len(sources) == 1:
        return sources[0]
    formats = {(bits, group_size, arrays[1].dtype if bits else None) for arrays, bits, group_size in sources}
    if len(formats) == 1 and sources[0][1]:
        _, bits, group_size = sources[0]
        return [mx.concatenate([a[i] for a, _, _ in sources], axis=2) for i in range(3)], bits, group_size
    dense = [a[0] if not bits else _dense(a, bits, group_size) for a, bits, group_size in sources]
    return [mx.concatenate(dense, axis=2)], 0, 0


# The segment op's limit (csrc/kernels/attention_problem.h), kept so both implementations accept the
# same calls.
MAX_SEGMENTS = 4


def _fast(q, segments, scale, mask_mode, mask, scores, sinks, stream):
    if not 1 <= len(segments) <= MAX_SEGMENTS:
        raise ValueError(f"at least one and at most {MAX_SEGMENTS} K/V segments, got {len(segments)}")
    # (the extension reads a segment's leading rows in place; mx.fast's ops take them sliced)
    sources = [((_leading(ka, kr), kb, kg), (_leading(va, vr), vb, vg)) for ka, kb, kg, kr, va, vb, vg, vr in segments]
    live = [kv for kv in sources if _length(kv[0][0]) > 0] or sources[:1]
    k = _merge([kv[0] for kv in live])
    v = _merge([kv[1] for kv in live])
    if bool(k[1]) != bool(v[1]) or (k[1] and k[1:] != v[1:]):  # the quantized op takes one format
        k = ([_dense(*k)], 0, 0) if k[1] else k
        v = ([_dense(*v)], 0, 0) if v[1] else v
    kwargs = dict(
        scale=scale,
        mask=mask if mask_mode == "array" else (mask_mode or None),
        scores=scores or None,
        sinks=sinks,
        stream=stream,
    )
    if k[1]:
        out, result = mx.fast.quantized_scaled_dot_product_attention_with_scores(
            q, *k[0], *v[0], group_size=k[2], bits=k[1], **kwargs
        )
    else:
        out, result = mx.fast.scaled_dot_product_attention_with_scores(q, k[0][0], v[0][0], **kwargs)
    # mx.fast's dense op returns the promoted type of q, k and v (as MLX's attention does); this op
    # returns q's, and a merged K/V may be float32 where q is not.
    out = out.astype(q.dtype, stream=stream) if out.dtype != q.dtype else out
    return [out] if result is None else [out, result]


def _leading(arrays, rows: int) -> list:
    """The arrays' first `rows` rows (-1: all)."""
    return arrays if rows < 0 else [a[:, :, :rows] for a in arrays]


def _length(arrays) -> int:
    return arrays[0].shape[2] if arrays and arrays[0].ndim == 4 else 1


def attention_with_scores(q, segments, scale, mask_mode, mask, scores, sinks, composed, stream, q_rotation=None, out_rotation=None,
                          score_column=None):
    """The extension's segment op (`_ext.attention_with_scores`, same arguments and result), run by the
    implementation in use."""
    if composed or implementation() == "ext":
        return _ext.attention_with_scores(q, segments, scale, mask_mode, mask, scores, sinks, composed,
                                          q_rotation=q_rotation, out_rotation=out_rotation, score_column=score_column, stream=stream)
    # mx.fast's ops take no rotations: the extension's rotate_rows around them, the same sums
    dtype = q.dtype
    if q_rotation is not None:
        q = _ext.rotate_rows(q, q_rotation, mx.float32, stream=stream)
    res = _fast(q, segments, scale, mask_mode, mask, scores, sinks, stream)
    if out_rotation is not None:
        res[0] = _ext.rotate_rows(res[0], out_rotation, dtype, stream=stream)
    elif res[0].dtype != dtype:
        res[0] = res[0].astype(dtype, stream=stream)
    if score_column is not None:  # mx.fast's ops fold no column: the extension's op for it
        acc, alpha, beta, held = score_column
        res.append(_ext.accumulate_prefix(acc, res[1], alpha, beta, held, stream=stream))
    return res
