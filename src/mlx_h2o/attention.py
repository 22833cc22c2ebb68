"""`scaled_dot_product_attention_with_scores`: attention that also reports the attention each cached
position received, from the same pass over K and V.

CPU streams run the fused C++ kernel (csrc/kernels/attention_cpu_impl.h: one pass over K/V per kv
head with an online softmax, GQA without repeating K/V, f16/bf16 or packed 2-8-bit K/V converted in
registers, threads over heads and key splits). Other streams (GPU) run the composed MLX ops
(`composed=True`): correct, unfused.
"""

from typing import NamedTuple, Optional, Sequence, Tuple, Union

import mlx.core as mx

from . import _ops

SCORE_MODES = ("mass", "logits", None)


def _native_args(mask, scores, sinks):
    if scores not in SCORE_MODES:
        raise ValueError(f"scores must be one of {SCORE_MODES}, got {scores!r}")
    if mask is None:
        mode, array = "", None
    elif isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"mask must be None, 'causal' or an mx.array, got {mask!r}")
        mode, array = "causal", None
    elif isinstance(mask, mx.array):
        mode, array = "array", mask
    else:
        raise ValueError(f"mask must be None, 'causal' or an mx.array, got {type(mask).__name__}")
    if sinks is not None and not isinstance(sinks, mx.array):
        raise ValueError(f"sinks must be None or an mx.array of shape (Hq,), got {type(sinks).__name__}")
    return mode, array, scores or "", sinks


def _attend(q, native_segments, scale, mask, scores, sinks, composed, stream, rotations=(None, None), score_column=None):
    """The one call into the segment op (the extension's or MLX's: _ops); every public function ends in it."""
    mode, array, score_mode, sinks = _native_args(mask, scores, sinks)
    for r, name in zip(rotations, ("q_rotation", "out_rotation")):
        if r is not None and not isinstance(r, mx.array):
            raise ValueError(f"{name} must be None or a float32 (D, D) mx.array, got {type(r).__name__}")
    if score_column is not None:
        score_column = _check_score_column(score_column)
    res = _ops.attention_with_scores(q, native_segments, _check_scale(scale), mode, array, score_mode, sinks, composed, stream,
                                     *rotations, score_column)
    if score_column is not None:
        return res[0], res[1], res[2]
    return res[0], (res[1] if len(res) > 1 else None)


def _check_score_column(column) -> tuple:
    if not isinstance(column, (tuple, list)) or len(column) != 4 or not isinstance(column[0], mx.array):
        raise ValueError("score_column must be (acc, alpha, beta, held): a float32 (B, Hkv, C) mx.array, two numbers and an int")
    acc, alpha, beta, held = column
    return acc, float(alpha), float(beta), _check_int(held, "held")


def _check_int(value, name) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return value


def _check_scale(scale) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ValueError(f"scale must be a number, got {scale!r}")
    return float(scale)


class PackedKV(NamedTuple):
    """K or V in MLX's affine packed format, as `mx.quantize` returns it, plus how it was packed.
    `rows` (None: all) reads only the first `rows` rows of the arrays: a cache reads its buffers,
    spare room included, in place, where slicing them would add three primitives to every decode step."""

    packed: mx.array
    scales: mx.array
    biases: mx.array
    bits: int
    group_size: int
    rows: Optional[int] = None

    @property
    def length(self) -> int:
        """The rows read."""
        return self.packed.shape[2] if self.rows is None else self.rows

    @property
    def arrays(self) -> Tuple[mx.array, mx.array, mx.array]:
        """(packed, scales, biases) of the rows read (slices of the arrays when `rows` is set)."""
        whole = (self.packed, self.scales, self.biases)
        return whole if self.rows is None else tuple(a[:, :, : self.rows] for a in whole)


class DenseRows(NamedTuple):
    """The first `rows` rows of a dense K or V buffer (B, H, capacity, D), read in place: what a cache
    attends over where its slice of the buffer would add a primitive to every decode step."""

    buffer: mx.array
    rows: int


def _segment_source(x, i: int, role: int):
    """(arrays, bits, group_size, rows) of one K or V, as the extension's op takes it (rows -1: all):
    segments[i][role], role 0 for K and 1 for V (the name formatted only for an error: an h2o
    decode step makes this call twice per layer)."""
    if isinstance(x, DenseRows):  # (first: a cache's dense rows, at every decode step)
        return [x.buffer], 0, 0, _check_int(x.rows, "rows")
    if isinstance(x, mx.array):
        return [x], 0, 0, -1
    if isinstance(x, PackedKV):
        return [x.packed, x.scales, x.biases], x.bits, x.group_size, -1 if x.rows is None else _check_int(x.rows, "rows")
    raise ValueError(f"segments[{i}][{role}] must be an mx.array, a PackedKV or DenseRows, got {type(x).__name__}")


def _triple(x, name):
    if not isinstance(x, (tuple, list)) or len(x) != 3 or not all(isinstance(a, mx.array) for a in x):
        raise ValueError(f"{name} must be a (packed, scales, biases) triple of mx.arrays as mx.quantize returns")
    return list(x)


def scaled_dot_product_attention_with_scores(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    mask: Optional[Union[str, mx.array]] = None,
    scores: Optional[str] = "mass",
    sinks: Optional[mx.array] = None,
    rows: Optional[int] = None,
    stream=None,
) -> Tuple[mx.array, Optional[mx.array]]:
    """Attention output plus the attention each cached position received.

    q: (B, Hq, L, Dk); k: (B, Hkv, N, Dk); v: (B, Hkv, N, Dv); Hq a multiple of Hkv (MHA, GQA, MQA);
    float32, float16 or bfloat16 (the output has q's dtype).
    mask: None, "causal" (query row i sits at absolute position N - L + i), or a boolean / additive
    array broadcastable to (B, Hq, L, N). A row whose every key is masked outputs zeros.
    scores: "mass" -> (B, Hkv, N) float32, the post-softmax probability each position received,
    summed over the query heads of its kv group and the L rows (what H2O accumulates);
    "logits" -> (B, Hq, L, N) float32 masked pre-softmax logits (q.k * scale + additive mask,
    -inf where masked); None -> no scores (plain fused attention).
    sinks: optional (Hq,) sink logits (gpt-oss): an extra softmax column with no value and no score.
    rows: read only the first `rows` positions of k and v (N = rows), in place: a cache's buffers
    with spare room, without a slice of them in the graph.
    Returns (out, scores).
    """
    if not isinstance(k, mx.array) or not isinstance(v, mx.array):
        _native_args(mask, scores, sinks)  # argument errors first, as for every op
        raise ValueError("k and v must be mx.arrays (for packed K/V use quantized_scaled_dot_product_attention_with_scores)")
    n = -1 if rows is None else _check_int(rows, "rows")
    if rows is not None and n < 0:
        raise ValueError(f"rows must be None (all) or at least 0, got {rows}")
    return _attend(q, [([k], 0, 0, n, [v], 0, 0, n)], scale, mask, scores, sinks, False, stream)


def quantized_scaled_dot_product_attention_with_scores(
    q: mx.array,
    k_q,
    v_q,
    *,
    scale: float,
    bits: int,
    group_size: int,
    mask: Optional[Union[str, mx.array]] = None,
    scores: Optional[str] = "mass",
    sinks: Optional[mx.array] = None,
    stream=None,
) -> Tuple[mx.array, Optional[mx.array]]:
    """`scaled_dot_product_attention_with_scores` over packed K/V: k_q, v_q are the
    (packed uint32, scales, biases) triples `mx.quantize(x, group_size, bits)` returns for x of shape
    (B, Hkv, N, D); bits 2, 3, 4, 5, 6 or 8; group_size 32, 64 or 128. The kernel reads the packed
    bytes and dequantizes in registers: no dequantized copy of the cache is made."""
    bits, group_size = _check_int(bits, "bits"), _check_int(group_size, "group_size")
    segment = (_triple(k_q, "k_q"), bits, group_size, -1, _triple(v_q, "v_q"), bits, group_size, -1)
    return _attend(q, [segment], scale, mask, scores, sinks, False, stream)


def attention_with_scores(q, segments: Sequence, *, scale, mask=None, scores="mass", sinks=None, composed=False,
                          q_rotation=None, out_rotation=None, score_column=None, stream=None):
    """Attention over several K/V segments taken in order, each an mx.array, a `PackedKV` or `DenseRows` (e.g.
    8-bit heavy hitters + a 4-bit recent window, or packed storage + a full-precision residual
    window), without concatenating them. Scores cover the concatenated positions.
    composed=True runs the stock-MLX-ops definition instead of the fused kernel.
    K/V stored rotated (storage/rotation.py): q_rotation, float32 (Dk, Dk), attends with
    q @ q_rotation in float32, and out_rotation, float32 (Dv, Dv), returns the output times it, in
    q's dtype; both as `rotate_rows` computes them, inside the op (no primitive of their own).
    score_column=(acc, alpha, beta, held), with scores="mass": a running per-key statistic, acc
    (B, Hkv, C >= N) float32, folded with the mass as `_ext.accumulate_prefix(acc, mass, alpha, beta,
    held)` does, an output of the same primitive: returns (out, scores, the new column)."""
    # (list and tuple first: the Sequence ABC's check took ~2 % of an h2o decode step's graph building)
    if not isinstance(segments, (list, tuple)) and (isinstance(segments, (str, bytes)) or not isinstance(segments, Sequence)):
        raise ValueError("segments must be a sequence of (k, v) pairs")
    native = []
    for i, seg in enumerate(segments):
        if not isinstance(seg, (tuple, list)) or len(seg) != 2:
            raise ValueError(f"segments[{i}] must be a (k, v) pair")
        native.append((*_segment_source(seg[0], i, 0), *_segment_source(seg[1], i, 1)))
    return _attend(q, native, scale, mask, scores, sinks, bool(composed), stream, (q_rotation, out_rotation), score_column)


def attention_with_scores_composed(q, k, v, *, scale, mask=None, scores="mass", sinks=None, stream=None):
    """The same computation as `scaled_dot_product_attention_with_scores` from stock MLX ops: the
    definition of the fused kernel, and what runs on GPU streams. Materialises (B, Hq, L, N)."""
    return attention_with_scores(q, [(k, v)], scale=scale, mask=mask, scores=scores, sinks=sinks, composed=True, stream=stream)
