"""Perplexity through a cache, by the project's protocol: prefill the first `prefill` tokens in one
call, then feed one token at a time, scoring the NLL of every next token. The same numbers for a full
cache must equal one teacher-forced forward pass (tests/test_harness.py): that is the check that the
cache path is exact, and what makes every other policy's ΔPPL meaningful.
"""

from typing import Callable, Optional

import mlx.core as mx
import numpy as np


def _nll(logits: mx.array, targets: mx.array) -> mx.array:
    logits = logits.astype(mx.float32)
    return mx.logsumexp(logits, axis=-1) - mx.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]


def teacher_forced_nll(model, tokens) -> np.ndarray:
    """NLL of tokens[:, 1:] from one forward pass over tokens[:, :-1]; (B, L-1) float64."""
    x = mx.array(np.asarray(tokens))
    x = x[None] if x.ndim == 1 else x
    out = _nll(model(x[:, :-1]), x[:, 1:])
    return np.array(out, dtype=np.float64)


def autoregressive_nll(
    model,
    tokens,
    cache,
    prefill: int = 32,
    progress: Optional[Callable[[int], None]] = None,
) -> np.ndarray:
    """NLL of tokens[:, 1:] through `cache`; returns (B, L-1) float64. tokens: (L,) or (B, L)."""
    x = mx.array(np.asarray(tokens))
    x = x[None] if x.ndim == 1 else x
    B, L = x.shape
    if not 1 <= prefill < L:
        raise ValueError(f"prefill must be in [1, {L}) for {L} tokens, got {prefill}")
    nll = [_nll(model(x[:, :prefill], cache=cache), x[:, 1 : prefill + 1])]
    mx.eval(nll[-1])
    if progress:
        progress(prefill)
    for t in range(prefill, L - 1):
        nll.append(_nll(model(x[:, t : t + 1], cache=cache), x[:, t + 1 : t + 2]))
        # Evaluate every step: the graph must not grow with the sequence, and caches that evict
        # decide from evaluated scores.
        mx.eval(nll[-1])
        if progress:
            progress(1)
    return np.array(mx.concatenate(nll, axis=1), dtype=np.float64)
