"""References the h2o tests share: float64 attention in NumPy, and a full cache masked to the
positions an h2o cache holds."""

import copy
from dataclasses import asdict
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as lm_cache

from mlx_h2o.caches.h2o import H2OKVCache


def np_attention(q, k, v, scale, sinks=None):
    """float64 causal attention (row i at N - L + i): output and per-row probabilities."""
    B, Hq, L, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G = Hq // Hkv
    kk, vv = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)
    logits = np.einsum("bhld,bhnd->bhln", q, kk) * scale
    allowed = np.arange(N)[None, :] <= np.arange(N - L, N)[:, None]
    logits = np.where(allowed, logits, -np.inf)
    if sinks is not None:
        logits = np.concatenate([np.broadcast_to(sinks[None, :, None, None], (B, Hq, L, 1)), logits], axis=-1)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    if sinks is not None:
        p = p[..., 1:]
    return np.einsum("bhln,bhnd->bhld", p, vv), p, np.where(allowed, logits[..., -N:], -np.inf)


class KeptPositionsReference(lm_cache.KVCache):
    """A full cache whose attention is masked to the positions its twin h2o cache holds: what the
    h2o layer must compute if keys, values, RoPE positions and the mask are all right."""

    def __init__(self, twin):
        super().__init__()
        self.twin = twin

    def attend(self, queries, keys, values, *, scale, mask=None, sinks=None):
        N, L = keys.shape[2], queries.shape[2]
        held = held_positions(self.twin)  # (B, Hc, n)
        held = (mx.arange(N)[None, None, :, None] == held[:, :, None, :]).any(axis=-1)  # (B, Hc, N)
        allowed = held[:, :, None, :] & (mx.arange(N)[None, :] <= mx.arange(N - L, N)[:, None])
        allowed = mx.repeat(allowed, queries.shape[1] // allowed.shape[1], axis=1)
        if isinstance(mask, mx.array) and mask.dtype != mx.bool_:
            allowed = mx.where(allowed, mask, -mx.inf)  # MLA: the mask carries the RoPE part of the logits
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=allowed, sinks=sinks)


def kept_positions(cache):
    """The twin of an h2o prompt cache for decoding.lockstep: each h2o layer's KeptPositionsReference
    (other layers: a copy of their own cache)."""
    return [KeptPositionsReference(c) if isinstance(c, H2OKVCache) else copy.deepcopy(c) for c in cache]


def held_positions(cache) -> mx.array:
    """(B, H, n) the positions each kv head of an h2o layer holds; heads of different lengths (per-head
    budgets: one lane each) padded with -1, which matches no position."""
    if len(cache.lanes) == 1:
        return cache.lanes[0].store.column("pos")
    C = max(lane.length for lane in cache.lanes)
    rows = [mx.pad(lane.store.column("pos"), [(0, 0), (0, 0), (0, C - lane.length)], constant_values=-1) for lane in cache.lanes]
    return mx.concatenate(rows, axis=1).reshape(*cache.shape, C)


def column(cache, name: str) -> mx.array:
    """A layer-wide h2o cache's column `name` ("acc", "pos", "mult") of the held entries, (B, H, n)."""
    (lane,) = cache.lanes
    return lane.store.column(name)


def head_lengths(cache) -> np.ndarray:
    """(B, H) entries each kv head of an h2o layer holds."""
    return np.array([lane.length for lane in cache.lanes]).reshape(cache.shape) if len(cache.lanes) > 1 else np.full(cache.shape, cache.length)


def flat_options(config) -> SimpleNamespace:
    """Every option of an H2OConfig by name (cfg.sink, cfg.score, ...), whatever part holds it: what the
    NumPy references read."""
    return SimpleNamespace(**{k: v for part in (config.budget, config.scorer, config.keeper, config.storage) for k, v in asdict(part).items()})
