"""The scorer of an h2o cache: how the attention an entry receives becomes the priority it is kept by.

The scoring rule (scoring.py) folds each attention call's statistic into a per-entry accumulator;
the scorer chains what eviction ranks by on top of it: expected attention of future queries,
a redundancy discount, neighbour pooling and chunk sums; and it decides what the attention call
reports (every query row, or the observation window's last rows).
"""

from dataclasses import dataclass
from functools import cached_property
from typing import Optional

import mlx.core as mx

from ...options import Choice, Float, Int, option
from ...storage import flat_rows
from .scoring import SCORE_RULES, ScoreRule, make_rule


@dataclass(frozen=True)
class Scorer:
    """What eviction ranks entries by (higher = kept).

    Parameters
    ----------
    score, decay:
        the scoring rule (scoring.py) and the decay of the `ema` / `logit_ema` rules.
    obs_window, obs_pool:
        score a prompt by what its last `obs_window` rows attend to, max-pooled over `obs_pool`
        positions (SnapKV).
    pool:
        rank an entry by the best priority within a centred window (spans survive whole).
    chunk:
        rank and evict contiguous chunks of positions by their summed priority (ChunkKV).
    expected:
        weight of the expected attention of future queries in the priority (Expected Attention).
    redundancy:
        discount for keys a newer key repeats (R-KV).
    """

    score: str = option(Choice(tuple(sorted(SCORE_RULES))), "normalised",
                        "scoring rule (caches/h2o/scoring.py); `normalised` has the lowest perplexity of those measured "
                        "at the same M (docs/h2o.md#scoring-rules-selection-split-m--256-unless-named)")
    decay: Optional[float] = option(Float(0.0, 1.0), None, "decay of the `ema` / `logit_ema` rules (unset: 0.95)")
    obs_window: int = option(Int(0), 0, "score a prompt by what its last N tokens attend to (SnapKV; 0 = off)")
    obs_pool: int = option(Int(1), 7, "pooling width of the observation-window scores")
    pool: int = option(Int(1), 1, "rank an entry by the best priority within a centred window of N entries (1 = off)")
    chunk: int = option(Int(1), 1, "rank and evict contiguous chunks of N positions by their summed priority (ChunkKV; 1 = single entries)")
    expected: float = option(
        Float(0.0, 1.0), 0.0,
        "weight of the expected attention of future queries (running query mean and variance) in the priority (Expected Attention; 0 = off)")
    redundancy: float = option(
        Float(0.0, 1.0), 0.0, "discount for keys a newer key repeats: priority x (1 - w x cosine similarity) (R-KV; 0 = off)")

    def __post_init__(self):
        self.rule  # decay must suit the rule

    @cached_property
    def rule(self) -> ScoreRule:
        return make_rule(self.score, self.decay)

    @property
    def uses_keys(self) -> bool:
        """Whether the priority looks at the held keys (expected attention, redundancy)."""
        return self.expected > 0 or self.redundancy > 0

    def priority(self, acc, positions, offset, keys=None, q_mean=None, q_var=None, scale=1.0) -> mx.array:
        """The rule's priority, then in order: expected attention blended in, redundancy discount,
        neighbour pooling, chunk sums. keys (dense, stored space), q_mean / q_var (running query
        statistics) and the attention scale are needed when `uses_keys`."""
        priority = self.rule.priority(acc, positions, offset)
        if self.expected > 0:
            priority = (1.0 - self.expected) * priority + self.expected * expected_attention(keys, q_mean, q_var, scale)
        if self.redundancy > 0:
            priority = priority * (1.0 - self.redundancy * key_redundancy(keys))
        if self.pool > 1:
            # An entry next to a heavy hitter ranks with it (the layout is in position order), so spans
            # survive whole: a copying (induction) head next reads the token after the one it attends to.
            priority = max_pool(priority, self.pool)
        return chunk_priority(priority, positions, self.chunk)

    def observe(self, op, queries: mx.array, mask, heads: int, held: int):
        """Run one attention call, `op(queries, mask, scores) -> (out, raw)`, over `held` entries and
        report what the rule folds in: (out, raw, stats (B, heads, held), rows, live), where rows is
        the query rows the statistic averages and live the mean number of entries a row attended."""
        L = queries.shape[2]
        w = self.obs_window
        if w and L > w:
            # Observation window (SnapKV): score the prompt by what its last w rows attend to, pooled
            # along positions, as if every row of the call attended that way.
            out, _ = op(queries, mask, None)
            _, raw = op(queries[:, :, -w:], _last_rows(mask, w, L), self.rule.op_scores)
            return out, raw, max_pool(self.rule.stats(raw, heads, w), self.obs_pool), L, held - (w - 1) / 2
        out, raw = op(queries, mask, self.rule.op_scores)
        return out, raw, self.rule.stats(raw, heads, L), L, held - (L - 1) / 2  # causal: mean entries a row saw


def _last_rows(mask, w: int, L: int):
    if mask is None or isinstance(mask, str):
        return mask  # "causal" puts row i at N - rows + i: right for the last w rows too
    if mask.ndim >= 2 and mask.shape[-2] == L:
        return mask[..., -w:, :]
    return mask


def expected_attention(keys: mx.array, q_mean: mx.array, q_var: mx.array, scale: float) -> mx.array:
    """Expected attention of future queries (Expected Attention, Devoto et al. 2025): for queries q ~
    N(mu, diag(var)) per query head, E[exp(s q.k)] = exp(s mu.k + s^2/2 sum_d var_d k_d^2); softmax
    over the held keys, summed over the query heads of each kv group and scaled by the entries held,
    so uniform attention scores G (the `normalised` rule's units). keys (B, H, N, D); q_mean, q_var
    (B, Hq, D) -> (B, H, N)."""
    B, H, N, D = keys.shape
    G = q_mean.shape[1] // H
    mu, var = q_mean.reshape(B, H, G, D), q_var.reshape(B, H, G, D)
    logits = scale * (mu @ keys.swapaxes(-1, -2)) + (0.5 * scale * scale) * (var @ (keys * keys).swapaxes(-1, -2))
    return N * mx.softmax(logits, axis=-1).sum(axis=2)


def unit_centred(keys: mx.array) -> mx.array:
    """Keys minus the head's mean key (keys share a common direction), scaled to unit length: their
    dot products are the cosine similarities that tell near-duplicates apart."""
    centred = keys - keys.mean(axis=2, keepdims=True)
    return centred * mx.rsqrt(mx.maximum((centred * centred).sum(axis=-1, keepdims=True), 1e-12))


def key_redundancy(keys: mx.array) -> mx.array:
    """How much of each key a newer held key repeats (R-KV): the largest cosine similarity, after
    removing the head's mean key (keys share a common direction), with any newer entry, clipped to
    [0, 1]; the newest entry scores 0. Of two near-duplicates the older goes first. (B, H, N, D) ->
    (B, H, N)."""
    N = keys.shape[2]
    unit = unit_centred(keys)
    sim = unit @ unit.swapaxes(-1, -2)
    newer = mx.arange(N)[None, :] > mx.arange(N)[:, None]
    return mx.clip(mx.where(newer, sim, -1.0).max(axis=-1), 0.0, 1.0)


def chunk_priority(priority: mx.array, positions: mx.array, chunk: int) -> mx.array:
    """Each entry ranked by the summed priority of the held entries of its chunk (positions
    [c * chunk, (c + 1) * chunk)), ChunkKV-style: whole chunks are kept or evicted, so what stays is
    readable text a copying head can follow. A partly evicted chunk sums less and goes next, so chunks
    do not stay broken. Positions ascend along the last axis. (B, H, N) -> (B, H, N)."""
    if chunk <= 1:
        return priority
    B, H, N = priority.shape
    cid = positions // chunk
    starts = mx.concatenate([mx.ones((B, H, 1), mx.int32), (cid[..., 1:] != cid[..., :-1]).astype(mx.int32)], axis=-1)
    rank = mx.cumsum(starts, axis=-1) - 1  # dense chunk index within (b, h)
    flat = flat_rows(rank.astype(mx.int32), N)
    sums = mx.zeros((B * H * N,), priority.dtype).at[flat].add(priority.reshape(-1))
    return sums[flat].reshape(B, H, N)


def max_pool(x: mx.array, width: int) -> mx.array:
    """Max over a centred window of `width` entries along the last axis (SnapKV's pooling: an entry
    next to a strongly attended one is kept with it, so multi-token facts survive whole)."""
    if width <= 1:
        return x
    left = (width - 1) // 2
    right = width - 1 - left
    N = x.shape[-1]
    pad_shape = list(x.shape)
    padded = mx.concatenate(
        [mx.full(pad_shape[:-1] + [left], -mx.inf, x.dtype), x, mx.full(pad_shape[:-1] + [right], -mx.inf, x.dtype)],
        axis=-1,
    )
    out = padded[..., 0:N]
    for k in range(1, width):
        out = mx.maximum(out, padded[..., k : k + N])
    return out
