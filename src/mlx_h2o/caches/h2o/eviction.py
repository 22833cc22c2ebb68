"""Eviction planning for the h2o cache: when to evict, how many entries to keep, and which.

All of it is a function of the configuration, the entries held (`length`), the tokens processed
(`offset`) and the tokens about to be appended (`L`), so `make_mask` can plan exactly the eviction
`update_and_fetch` will carry out.
"""

from typing import Optional

import mlx.core as mx

from ...storage import gather_rows, grown_capacity, pad_indices
from .options import H2OConfig
from .scoring import make_rule, max_pool


def keep_count(cfg: H2OConfig, length: int, offset: int, L: int) -> Optional[int]:
    """Entries of the current layout to keep before appending L tokens, or None for no eviction.
    The cache fills up to M entries (plus pinned ones); the token that would pass M triggers one
    compaction down to M - evict_every, so decode compacts once per `evict_every` tokens and never
    holds more than M. A call of L > 1 tokens (a prefill chunk) is appended whole after it."""
    pinned = cfg.pinned_before(offset)
    if length + L <= cfg.max_kv_size + pinned:
        return None
    target = cfg.max_kv_size - cfg.evict_every  # unpinned entries to keep
    keep = min(length - pinned, target) + pinned
    return keep if keep < length else None


def recent_kept(cfg: H2OConfig, offset: int, keep: int) -> int:
    """Entries of the recent window an eviction to `keep` protects (the new tokens complete it);
    they are the newest entries, the tail of the layout."""
    return max(keep - cfg.pinned_before(offset) - cfg.sink - cfg.heavy, 0)


def buffer_capacity(cfg: H2OConfig, offset: int, needed: int) -> int:
    """Rows to allocate for `needed` entries: the steady-state size (M + pinned) once reached, storage
    growth steps below it, exactly `needed` above it (a prefill chunk)."""
    steady = cfg.max_kv_size + cfg.pinned_before(offset + 1)
    if needed > steady:
        return needed
    return min(steady, grown_capacity(needed))


def select_entries(priority: mx.array, protected: mx.array, count: int, shared: bool) -> mx.array:
    """Indices (B, H, count), ascending, of the entries to keep: every protected entry, then the
    highest priorities (argpartition, not a sort). priority, protected: (B, H, P).

    shared=True picks one set per sequence for all heads from the priorities summed over heads
    (the heads then hold the same positions, so protection agrees) and returns (B, 1, count)."""
    if shared:
        priority = priority.sum(axis=1, keepdims=True)
        protected = protected.any(axis=1, keepdims=True)
    key = mx.where(protected, mx.inf, priority)
    idx = mx.argpartition(-key, kth=count - 1, axis=-1)[..., :count]
    return mx.sort(idx, axis=-1)


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


def merge_evicted(keys, values, kept, n_kept: int, mult, acc, threshold: float):
    """Keep, don't drop (CaM / D2O-style): each evicted entry whose key is within cosine similarity
    `threshold` (unit_centred) of a kept entry's is folded into the most similar kept entry: keys and
    values become the multiplicity-weighted means, multiplicities and score accumulators add up. The
    merged entry then stands for all its tokens: attention adds log(multiplicity) to its logit, so
    where keys coincide it receives the attention they all would have (token merging's proportional
    attention).

    keys, values (B, H, N, D) float32; kept (B, H, N) bool, n_kept True per (b, h); mult, acc
    (B, H, N). Returns (target
    (B, H, E) index of each evicted entry's merge target, and the new keys, values, mult, acc of
    those targets, each (B, H, E, ...)): rows of unmerged evictions come back unchanged, and several
    evicted entries sharing a target carry the same final row."""
    B, H, N, D = keys.shape
    unit = unit_centred(keys)
    sim = unit @ unit.swapaxes(-1, -2)  # (B, H, N, N)
    sim = mx.where(kept[:, :, None, :], sim, -mx.inf)
    best = mx.argmax(sim, axis=-1)  # (B, H, N): most similar kept entry
    best_sim = mx.take_along_axis(sim, best[..., None], axis=-1)[..., 0]
    merges = (~kept) & (best_sim >= threshold)
    # A[e, r] = 1 where evicted e folds into kept r.
    assign = (mx.arange(N)[None, None, None, :] == best[..., None]) & merges[..., None]
    w = mult.astype(mx.float32)
    into = assign.swapaxes(-1, -2).astype(mx.float32)  # (B, H, r, e)
    add_w = (into @ w[..., None])[..., 0]
    total = w + add_w
    new_k = (w[..., None] * keys + into @ (w[..., None] * keys)) / total[..., None]
    new_v = (w[..., None] * values + into @ (w[..., None] * values)) / total[..., None]
    new_acc = acc + (into @ acc[..., None])[..., 0]
    evicted = mx.argsort(kept.astype(mx.int32), axis=-1)[..., : N - n_kept]  # the evicted entries (kept sort last)
    target = mx.take_along_axis(best, evicted, axis=-1)
    return target, *(gather_rows(a, target) for a in (new_k, new_v, total, new_acc))


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
    flat = (rank + (mx.arange(B * H, dtype=mx.int32) * N).reshape(B, H, 1)).reshape(-1)
    sums = mx.zeros((B * H * N,), priority.dtype).at[flat].add(priority.reshape(-1))
    return sums[flat].reshape(B, H, N)


_EVICTION_PLANS = {}


def uses_keys(config: H2OConfig) -> bool:
    """Whether eviction looks at the held keys (expected attention, redundancy)."""
    return config.expected > 0 or config.redundancy > 0


def eviction_plan(config: H2OConfig, scoreless: bool):
    """plan(acc, positions, offset, recent_from, keep, capacity, *content) -> (B, H, capacity)
    indices of the entries to keep (ascending), padded for a gather into buffers of `capacity`
    rows: the rule's priorities (or recency, for a cache that saw no scores), blended with expected
    attention and discounted by redundancy where configured (keys: the held keys,
    dense; q_mean / q_var: the running query statistics; scale: the attention's; `content` is
    (keys, q_mean, q_var, scale) when `uses_keys`, else empty), ranked by chunk, with sink, recent
    (positions >= recent_from) and pinned entries forced in. Compiled once per configuration and
    shape and shared by every layer: ~15 small ops per layer and step become one fused call (150 ->
    46 µs at M = 512)."""
    key = (config, scoreless)
    if key not in _EVICTION_PLANS:
        rule = make_rule(config.score, config.decay)

        def plan(acc, positions, offset, recent_from, keep, capacity, *content):
            # With no attention seen, keep the most recent.
            if scoreless:
                priority = positions.astype(mx.float32)
            else:
                priority = entry_priority(config, rule, acc, positions, offset, *content)
            protected = (positions < config.sink) | (positions >= recent_from)
            pinned = config.pinned_mask(positions)
            if pinned is not None:
                protected = protected | pinned
            idx = select_entries(priority, protected, keep, config.select == "layer")
            return pad_indices(mx.broadcast_to(idx, (*acc.shape[:2], keep)), capacity)

        _EVICTION_PLANS[key] = mx.compile(plan)
    return _EVICTION_PLANS[key]


def entry_priority(config: H2OConfig, rule, acc, positions, offset, keys=None, q_mean=None, q_var=None, scale=1.0):
    """What eviction ranks entries by (higher = kept): the scoring rule's priority, then in order the
    configured transforms: expected attention blended in, redundancy discount, neighbour pooling,
    chunk sums."""
    priority = rule.priority(acc, positions, offset)
    if config.expected > 0:
        priority = (1.0 - config.expected) * priority + config.expected * expected_attention(keys, q_mean, q_var, scale)
    if config.redundancy > 0:
        priority = priority * (1.0 - config.redundancy * key_redundancy(keys))
    if config.pool > 1:
        # An entry next to a heavy hitter ranks with it (the layout is in position order), so spans
        # survive whole: a copying (induction) head next reads the token after the one it attends to.
        priority = max_pool(priority, config.pool)
    return chunk_priority(priority, positions, config.chunk)
