"""`scaled_dot_product_attention_with_scores`: attention that also reports the attention each cached
position received.

CPU streams run the fused C++ kernel (csrc/); other streams run the composed MLX ops below
(correct, unfused). The composed path is also the readable definition of what the kernel computes.
"""

from typing import Optional, Union

import mlx.core as mx

SCORE_MODES = ("mass", "logits", None)


def _composed(q, k, v, scale, mask, scores, sinks=None):
    B, Hq, L, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G = Hq // Hkv
    qg = q.astype(mx.float32).reshape(B, Hkv, G, L, D) * scale
    kf = k.astype(mx.float32)[:, :, None]
    vf = v.astype(mx.float32)[:, :, None]
    logits = qg @ kf.swapaxes(-1, -2)  # (B, Hkv, G, L, N)
    if isinstance(mask, str):
        rows = mx.arange(N - L, N)[:, None]
        logits = mx.where(rows >= mx.arange(N)[None], logits, -mx.inf)
    elif mask is not None:
        m = mx.broadcast_to(mask, (B, Hq, L, N)).reshape(B, Hkv, G, L, N)
        logits = mx.where(m, logits, -mx.inf) if m.dtype == mx.bool_ else logits + m.astype(mx.float32)
    if sinks is not None:
        # gpt-oss style attention sinks: one extra logit per query head that takes probability mass
        # but has no value; it is not a cached position, so it gets no score.
        sink = mx.broadcast_to(sinks.astype(mx.float32).reshape(1, Hkv, G, 1, 1), (B, Hkv, G, L, 1))
        probs = mx.softmax(mx.concatenate([sink, logits], axis=-1), axis=-1, precise=True)[..., 1:]
    else:
        probs = mx.softmax(logits, axis=-1, precise=True)
    out = (probs @ vf).reshape(B, Hq, L, D).astype(q.dtype)
    if scores == "mass":
        return out, probs.sum(axis=(2, 3))
    if scores == "logits":
        return out, logits.reshape(B, Hq, L, N)
    return out, None


def scaled_dot_product_attention_with_scores(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    mask: Optional[Union[str, mx.array]] = None,
    scores: Optional[str] = "mass",
    sinks: Optional[mx.array] = None,
    stream=None,
):
    """Attention output plus the attention each cached position received.

    q: (B, Hq, L, D); k, v: (B, Hkv, N, D) with Hq a multiple of Hkv.
    mask: None, "causal" (query row i sits at absolute position N - L + i), or a boolean / additive
    array broadcastable to (B, Hq, L, N).
    scores: "mass" -> (B, Hkv, N) float32 post-softmax probability summed over the query heads of
    each kv group and the L rows; "logits" -> (B, Hq, L, N) float32 pre-softmax scores; None -> None.
    sinks: optional (Hq,) per-head sink logits (gpt-oss): an extra softmax column with no value.
    Returns (out, scores) with out in q's dtype.
    """
    if scores not in SCORE_MODES:
        raise ValueError(f"scores must be one of {SCORE_MODES}, got {scores!r}")
    return _composed(q, k, v, scale, mask, scores, sinks)
