"""`scaled_dot_product_attention_with_scores`: attention that also reports the attention each cached
position received, from the same pass over K and V.

CPU streams run the fused C++ kernel (csrc/kernels/attention_cpu_impl.h: one pass over K/V per kv
head with an online softmax, GQA without repeating K/V, f16/bf16 converted in registers, threads
over heads and key splits). Other streams (GPU) run the composed MLX ops of
`attention_with_scores_composed`: correct, unfused.
"""

from typing import Optional, Tuple, Union

import mlx.core as mx

from . import _ext

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


def _check_scale(scale) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ValueError(f"scale must be a number, got {scale!r}")
    return float(scale)


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
) -> Tuple[mx.array, Optional[mx.array]]:
    """Attention output plus the attention each cached position received.

    q: (B, Hq, L, Dk); k: (B, Hkv, N, Dk); v: (B, Hkv, N, Dv); Hq a multiple of Hkv (MHA, GQA, MQA);
    float32, float16 or bfloat16 (k and v share a dtype; the output has q's dtype).
    mask: None, "causal" (query row i sits at absolute position N - L + i), or a boolean / additive
    array broadcastable to (B, Hq, L, N). A row whose every key is masked outputs zeros.
    scores: "mass" -> (B, Hkv, N) float32, the post-softmax probability each position received,
    summed over the query heads of its kv group and the L rows (what H2O accumulates);
    "logits" -> (B, Hq, L, N) float32 masked pre-softmax logits (q.k * scale + additive mask,
    -inf where masked); None -> no scores (plain fused attention).
    sinks: optional (Hq,) sink logits (gpt-oss): an extra softmax column with no value and no score.
    Returns (out, scores).
    """
    mode, array, score_mode, sinks = _native_args(mask, scores, sinks)
    res = _ext.scaled_dot_product_attention_with_scores(q, k, v, _check_scale(scale), mode, array, score_mode, sinks, stream)
    return res[0], (res[1] if len(res) > 1 else None)


def attention_with_scores_composed(q, k, v, *, scale, mask=None, scores="mass", sinks=None, stream=None):
    """The same computation from stock MLX ops: the definition of the fused kernel, and what runs on
    GPU streams. Materialises the (B, Hq, L, N) attention matrix."""
    mode, array, score_mode, sinks = _native_args(mask, scores, sinks)
    res = _ext.attention_with_scores_composed(q, k, v, _check_scale(scale), mode, array, score_mode, sinks, stream)
    return res[0], (res[1] if len(res) > 1 else None)
