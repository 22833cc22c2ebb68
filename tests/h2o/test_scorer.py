"""The scorer of the h2o cache (caches/h2o/scoring.py, eviction.py): scoring rules, expected
attention, redundancy, pooling, chunks and the observation window, against NumPy references of
the selection and the score updates."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_h2o.caches.h2o import H2OConfig, H2OKVCache

from .references import column, flat_options, np_attention


# ----------------------------------------------------------------------------- NumPy references
def _np_expected(keys, q_mean, q_var, scale):
    """Expected attention, written out per (b, kv head, query head of its group)."""
    B, H, N, D = keys.shape
    G = q_mean.shape[1] // H
    out = np.zeros((B, H, N))
    for b in range(B):
        for h in range(H):
            for g in range(G):
                j = h * G + g
                logit = np.array([scale * q_mean[b, j] @ k + 0.5 * scale**2 * (q_var[b, j] * k * k).sum() for k in keys[b, h].astype(np.float64)])
                p = np.exp(logit - logit.max())
                out[b, h] += N * p / p.sum()
    return out


def _np_redundancy(keys):
    B, H, N, D = keys.shape
    out = np.zeros((B, H, N))
    for b in range(B):
        for h in range(H):
            c = keys[b, h].astype(np.float64) - keys[b, h].astype(np.float64).mean(axis=0)
            for i in range(N):
                sims = [c[i] @ c[j] / max(np.linalg.norm(c[i]) * np.linalg.norm(c[j]), 1e-6) for j in range(i + 1, N)]
                out[b, h, i] = min(max(max(sims, default=0.0), 0.0), 1.0)
    return out


def _np_chunk(prio, pos, chunk):
    if chunk <= 1:
        return prio
    out = np.empty_like(prio)
    for b in range(prio.shape[0]):
        for h in range(prio.shape[1]):
            cid = pos[b, h] // chunk
            for i in range(prio.shape[2]):
                out[b, h, i] = prio[b, h][cid == cid[i]].sum()
    return out


def _np_priority(cfg, acc, pos, offset, content=None):
    """content: (held keys (B, H, P, D), query mean, query variance (B, Hq, D), scale)."""
    prio = acc / (offset - pos).astype(np.float32) if cfg.score == "normalised" else acc
    if cfg.expected > 0:
        prio = (1 - cfg.expected) * prio + cfg.expected * _np_expected(*content)
    if cfg.redundancy > 0:
        prio = prio * (1 - cfg.redundancy * _np_redundancy(content[0]))
    return _np_chunk(prio, pos, cfg.chunk)


def _np_keep(cfg, acc, pos, offset, L, content=None):
    """The selection rule, written out: positions kept per (b, h) before appending L tokens."""
    M, e = cfg.max_kv_size, cfg.evict_every
    P = pos.shape[-1]
    pinned_old = sum(max(0, min(b, offset) - a) for a, b in cfg.pin)
    if P + L <= M + pinned_old:
        return pos
    target = M - e
    keep = min(P - pinned_old, target) + pinned_old
    if keep >= P:
        return pos
    recent_old = max(target - cfg.sink - cfg.heavy, 0)
    prio = _np_priority(cfg, acc, pos, offset, content)
    protected = (pos < cfg.sink) | (pos >= offset - recent_old)
    for a, b in cfg.pin:
        protected |= (pos >= a) & (pos < b)
    if cfg.select == "layer":
        prio = np.broadcast_to(prio.sum(axis=1, keepdims=True), prio.shape)
    out = np.empty(pos.shape[:2] + (keep,), pos.dtype)
    for b in range(pos.shape[0]):
        for h in range(pos.shape[1]):
            order = sorted(range(P), key=lambda j: (not protected[b, h, j], -prio[b, h, j]))
            out[b, h] = np.sort(pos[b, h, order[:keep]])
    return out


def _np_update(cfg, acc, q, k, v, scale, L, w, pool):
    B, Hq, _, _ = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G = Hq // Hkv
    rows = slice(L - w, L) if (w and L > w) else slice(0, L)
    n_rows = rows.stop - rows.start
    out, p, logits = np_attention(q, k, v, scale)
    if cfg.score == "logit_ema":
        lg = logits[:, :, rows]
        stats = np.where(np.isfinite(lg), np.abs(lg), 0).mean(axis=2).reshape(B, Hkv, G, N).mean(axis=2)
    else:
        stats = p[:, :, rows].sum(axis=2).reshape(B, Hkv, G, N).sum(axis=2) / n_rows
    if w and L > w and pool > 1:
        left = (pool - 1) // 2
        padded = np.pad(stats, [(0, 0), (0, 0), (left, pool - 1 - left)], constant_values=-np.inf)
        stats = np.max([padded[..., i : i + N] for i in range(pool)], axis=0)
    live = N - (n_rows - 1) / 2
    decay = 0.95 if cfg.decay is None else cfg.decay
    if cfg.score == "cumulative":
        new = acc + L * stats
    elif cfg.score == "normalised":
        new = acc + L * live * stats
    else:
        new = decay**L * acc + (1 - decay**L) * stats
    return out, new


SCHEDULE = [5] + [1] * 40 + [7] + [1] * 25 + [12] + [1] * 10


@pytest.mark.parametrize(
    "options",
    [
        dict(score="cumulative"),
        dict(score="ema", evict_every=4),
        dict(score="normalised", select="layer"),
        dict(score="logit_ema", decay=0.8),
        dict(score="normalised", evict_every=3, pin=[(6, 9), (20, 22)]),
        dict(score="ema", obs_window=3, obs_pool=3, split="balanced"),
        dict(score="cumulative", split="explicit", sink=2, heavy=9, recent=5),
        dict(score="normalised", chunk=4),
        dict(score="cumulative", chunk=3, evict_every=2),
        dict(score="normalised", expected=0.6),
        dict(score="normalised", redundancy=0.7, evict_every=3),
        dict(score="ema", expected=0.3, redundancy=0.5, chunk=2),
    ],
)
def test_eviction_and_scores_match_numpy_reference(options):
    config = H2OConfig.build(16, **options)
    cache = H2OKVCache(config)
    cfg = flat_options(config)  # the references read every option by name
    rng = np.random.default_rng(sum(map(ord, repr(options))))
    B, Hkv, G, D = 2, 2, 3, 8
    scale = D**-0.5
    ref_keys = {}  # (b, h, position) -> key vector
    q_mean = q_sq = None  # running query statistics (expected attention)
    evicted = 0
    for L in SCHEDULE:
        before = (np.array(column(cache, "acc")), np.array(column(cache, "pos"))) if cache.length else None
        content = None
        if before is not None and (cfg.expected or cfg.redundancy):
            held = np.stack([[[ref_keys[b, h, p] for p in before[1][b, h]] for h in range(Hkv)] for b in range(B)])
            content = (held, q_mean, np.maximum(q_sq - q_mean**2, 0), scale)
        k = rng.standard_normal((B, Hkv, L, D)).astype(np.float32)
        v = rng.standard_normal((B, Hkv, L, D)).astype(np.float32)
        offset = cache.offset
        keys, values = cache.update_and_fetch(mx.array(k), mx.array(v))
        pos = np.array(column(cache, "pos"))
        new = np.broadcast_to(np.arange(offset, offset + L), (B, Hkv, L))
        if before is not None:
            kept = _np_keep(cfg, *before, offset, L, content)
            evicted += kept.shape[-1] < before[1].shape[-1]
            np.testing.assert_array_equal(pos, np.concatenate([kept, new], axis=-1))
        assert cache.length <= cfg.max_kv_size + config.budget.pinned_before(cache.offset) or L > 1
        for b in range(B):
            for h in range(Hkv):
                for j in range(L):
                    ref_keys[b, h, offset + j] = k[b, h, j]
        kk = np.array(keys)
        for b in range(B):
            for h in range(Hkv):
                np.testing.assert_array_equal(kk[b, h], np.stack([ref_keys[b, h, p] for p in pos[b, h]]))
        q = rng.standard_normal((B, Hkv * G, L, D)).astype(np.float32)
        q[:, :, :, 0] += 2.0  # a query direction the statistics can find
        d = 0.95**L
        q_mean = q.mean(axis=2) if q_mean is None else d * q_mean + (1 - d) * q.mean(axis=2)
        q_sq = (q * q).mean(axis=2) if q_sq is None else d * q_sq + (1 - d) * (q * q).mean(axis=2)
        acc = np.array(column(cache, "acc"))
        out = cache.attend(mx.array(q), keys, values, scale=scale, mask="causal" if L > 1 else None)
        ref_out, ref_acc = _np_update(cfg, acc, q, kk, np.array(values), scale, L, cfg.obs_window, cfg.obs_pool)
        np.testing.assert_allclose(np.array(out), ref_out, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(np.array(column(cache, "acc")), ref_acc, rtol=2e-4, atol=1e-6)
    assert evicted > 10
    for a, b in cfg.pin:
        assert all(set(range(a, b)) <= set(row) for row in np.array(column(cache, "pos")).reshape(-1, cache.length))


@pytest.mark.parametrize("pool", [1, 3, 5])
def test_pooled_priority_keeps_the_neighbours_of_a_heavy_hitter(pool):
    from mlx_h2o.caches.h2o import eviction_plan

    config = H2OConfig.build(16, split="explicit", sink=2, heavy=pool * 2, recent=14 - pool * 2, score="cumulative", pool=pool)
    P = 40
    acc = mx.random.uniform(0, 1, (1, 2, P), key=mx.random.key(pool))
    acc[:, 0, 17] = 100.0  # head 0: one heavy hitter; head 1: random scores only
    positions = mx.broadcast_to(mx.arange(P, dtype=mx.int32), (1, 2, P))
    keep = 15
    recent = keep - config.budget.sink - config.budget.heavy
    idx = eviction_plan(config.budget, config.scorer, False)(acc, positions, mx.array(P, mx.int32), mx.array(P - recent, mx.int32), keep, 16)
    kept = [set(np.array(idx[0, h, :keep]).tolist()) for h in range(2)]
    half = pool // 2
    assert set(range(17 - half, 18 + half)) <= kept[0]
    # Reference for every head: unprotected entries ranked by the pooled score (NumPy).
    a = np.array(acc)
    for h in range(2):
        pooled = np.array([a[0, h, max(i - half, 0): i + half + 1].max() for i in range(P)])
        protected = {0, 1, *range(P - recent, P)}
        assert protected <= kept[h]
        free = sorted((pooled[i] for i in range(P) if i not in protected), reverse=True)[: keep - len(protected)]
        # Ties (neighbours share a pooled maximum) may be broken either way: compare the scores kept.
        np.testing.assert_array_equal(sorted((pooled[i] for i in kept[h] - protected), reverse=True), free)
    assert np.all(np.diff(np.array(idx[0, :, :keep]), axis=-1) > 0)
