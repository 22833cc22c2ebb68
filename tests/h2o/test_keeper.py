"""The keeper of the h2o cache: keep, don't drop. Evicted entries merged into their most similar kept
entry, or archived at low bits in a third tier (caches/h2o/keeper.py)."""

import mlx.core as mx
import numpy as np
import pytest
from attention_reference import reference
from decoding import step_logits, tokens
from tiny_models import tiny_model

import mlx_h2o
from mlx_h2o import _ops
from mlx_h2o.caches.h2o import H2OConfig, H2OKVCache
from mlx_h2o.storage import role_bits

from .references import column, np_attention


# ----------------------------------------------------------------------------- merge
def _np_merge(keys, values, kept, mult, acc, threshold):
    B, H, N, D = keys.shape
    k, v, m, a = keys.astype(np.float64).copy(), values.astype(np.float64).copy(), mult.astype(np.float64).copy(), acc.astype(np.float64).copy()
    targets = {}
    for b in range(B):
        for h in range(H):
            c = keys[b, h].astype(np.float64) - keys[b, h].astype(np.float64).mean(axis=0)
            u = c / np.maximum(np.linalg.norm(c, axis=1, keepdims=True), 1e-6)
            into = {}
            for e in np.flatnonzero(~kept[b, h]):
                cand = np.flatnonzero(kept[b, h])
                r = cand[np.argmax(u[cand] @ u[e])]
                targets[b, h, e] = r
                if u[r] @ u[e] >= threshold:
                    into.setdefault(r, []).append(e)
            for r, es in into.items():
                w = np.array([mult[b, h, r]] + [mult[b, h, e] for e in es], np.float64)
                rows = [r] + es
                k[b, h, r] = (w[:, None] * keys[b, h, rows]).sum(0) / w.sum()
                v[b, h, r] = (w[:, None] * values[b, h, rows]).sum(0) / w.sum()
                m[b, h, r], a[b, h, r] = w.sum(), acc[b, h, rows].sum()
    return targets, k, v, m, a


@pytest.mark.parametrize("threshold", [-1.0, 0.2, 0.9])
def test_merge_evicted_matches_numpy(threshold):
    from mlx_h2o.caches.h2o.keeper import merge_evicted

    rng = np.random.default_rng(int(10 * threshold) + 20)
    B, H, N, D, keep = 2, 2, 14, 8, 9
    keys = rng.standard_normal((B, H, N, D)).astype(np.float32)
    keys[:, :, 10] = keys[:, :, 3] + 0.01  # near-duplicates merge at any threshold
    values = rng.standard_normal((B, H, N, D)).astype(np.float32)
    kept = np.zeros((B, H, N), bool)
    for b in range(B):
        for h in range(H):
            kept[b, h, rng.permutation([i for i in range(N) if i != 10])[:keep]] = True
    mult = rng.integers(1, 4, (B, H, N)).astype(np.float32)
    acc = rng.random((B, H, N)).astype(np.float32)
    target, k, v, m, a = merge_evicted(*map(mx.array, (keys, values, kept)), keep, mx.array(mult), mx.array(acc), threshold)
    targets, rk, rv, rm, ra = _np_merge(keys, values, kept, mult, acc, threshold)
    target = np.array(target)
    for b in range(B):
        for h in range(H):
            evicted = sorted(np.flatnonzero(~kept[b, h]))
            assert sorted(target[b, h]) == sorted(targets[b, h, e] for e in evicted)
            for j, r in enumerate(target[b, h]):
                np.testing.assert_allclose(np.array(k)[b, h, j], rk[b, h, r], rtol=1e-5, atol=1e-5)
                np.testing.assert_allclose(np.array(v)[b, h, j], rv[b, h, r], rtol=1e-5, atol=1e-5)
                assert np.array(m)[b, h, j] == rm[b, h, r] and np.array(a)[b, h, j] == pytest.approx(ra[b, h, r], rel=1e-5)
    if threshold <= 0.2:
        assert (rm > mult).any()


def test_merged_duplicates_attend_exactly_like_the_full_cache():
    """Tokens with identical keys and values merged into one entry with log(2) on its logit are
    exactly the attention over both: proportional attention."""
    cfg = H2OConfig.build(12, split="explicit", sink=2, heavy=4, recent=6, merge=0.99)
    cache = H2OKVCache(cfg)
    rng = np.random.default_rng(5)
    B, H, G, D = 1, 2, 2, 8
    base_k = rng.standard_normal((B, H, 20, D)).astype(np.float32)
    base_v = rng.standard_normal((B, H, 20, D)).astype(np.float32)
    # Tokens 2..7 repeat tokens 8..13: whatever of them is evicted has an identical kept twin.
    order = list(range(2)) + list(range(8, 14)) + list(range(8, 20))
    k_all, v_all = base_k[:, :, order], base_v[:, :, order]
    exact_after_merge = 0
    for t in range(k_all.shape[2]):
        keys, values = cache.update_and_fetch(mx.array(k_all[:, :, t : t + 1]), mx.array(v_all[:, :, t : t + 1]))
        q = rng.standard_normal((B, H * G, 1, D)).astype(np.float32)
        out = cache.attend(mx.array(q), keys, values, scale=D**-0.5)
        ref, _, _ = np_attention(q, k_all[:, :, : t + 1], v_all[:, :, : t + 1], D**-0.5)
        # While the held entries are the distinct tokens seen so far, each with its count (nothing was
        # dropped or blended with a different key), attention must be exact.
        held, mult = np.array(keys), np.array(column(cache, "mult"))
        seen = {j: order[: t + 1].count(j) for j in set(order[: t + 1])}
        for h in range(H):
            ids = [int(np.argmin(np.abs(base_k[0, h] - r).sum(-1))) for r in held[0, h]]
            held_counts = {}
            for j, m in zip(ids, mult[0, h]):
                held_counts[j] = held_counts.get(j, 0) + m
            if held_counts == seen and np.array_equal(held[0, h], base_k[0, h, ids]):
                group = slice(h * G, (h + 1) * G)
                np.testing.assert_allclose(np.array(out)[:, group], ref[:, group], rtol=1e-4, atol=1e-5)
                exact_after_merge += bool(mult[0, h].max() > 1)
    assert cache.evictions > 0 and exact_after_merge >= 3


def test_merge_accounts_for_every_token():
    model = tiny_model("llama")
    cache = mlx_h2o.make_cache(model, "h2o", max_kv_size=20, merge=-1.0, evict_every=2)
    step_logits(model, tokens(90, seed=12, batch=2), cache)
    for c in cache:
        np.testing.assert_allclose(np.array(column(c, "mult")).sum(axis=-1), 90)  # every token is in some entry
    # A threshold no pair of keys reaches merges nothing: plain h2o.
    plain = step_logits(model, tokens(90, seed=12, batch=2), mlx_h2o.make_cache(model, "h2o", max_kv_size=20, evict_every=2))
    never = step_logits(model, tokens(90, seed=12, batch=2), mlx_h2o.make_cache(model, "h2o", max_kv_size=20, evict_every=2, merge=0.99999))
    np.testing.assert_allclose(never, plain, atol=1e-5)
    with pytest.raises(ValueError, match="one storage format"):
        H2OConfig.build(16, merge=0.5, kv_bits="mixed")


# ----------------------------------------------------------------------------- evicted entries at low bits
@pytest.mark.parametrize("options", [dict(evicted_bits=4), dict(evicted_bits="k8v4", evicted_share=0.25, score="cumulative"),
                                     dict(evicted_bits=2, kv_bits=8, evict_every=3)])
def test_archive_attends_over_both_tiers_at_equal_bytes(options):
    cfg = H2OConfig.build(16, **options)
    cache = H2OKVCache(cfg)
    plain = H2OKVCache(H2OConfig.build(16, **{k: v for k, v in options.items() if not k.startswith("evicted")}))
    rng = np.random.default_rng(len(repr(options)))
    B, H, G, D = 2, 2, 2, 32
    scale = D**-0.5
    bits = role_bits(cfg.keeper.archive_format)
    originals = {}  # (b, h, position) -> (key, value)
    for L in [6] + [1] * 70 + [5] + [1] * 10:
        k = rng.standard_normal((B, H, L, D)).astype(np.float32)
        v = rng.standard_normal((B, H, L, D)).astype(np.float32)
        for b in range(B):
            for h in range(H):
                for j in range(L):
                    originals[b, h, cache.offset + j] = (k[b, h, j], v[b, h, j])
        for c in (cache, plain):
            keys, values = c.update_and_fetch(mx.array(k), mx.array(v))
            if c is cache:
                own = (keys, values)
        q = rng.standard_normal((B, H * G, L, D)).astype(np.float32)
        lane = cache.lanes[0]
        T = lane.archived
        arch_acc = None if not T else np.array(lane.archive.column("acc"))
        acc = np.array(column(cache, "acc"))
        out = cache.attend(mx.array(q), *own, scale=scale, mask="causal" if L > 1 else None)
        plain.attend(mx.array(q), keys, values, scale=scale, mask="causal" if L > 1 else None)
        ak, av = (np.zeros((B, H, 0, D), np.float32),) * 2 if not T else map(np.array, lane.archive.read_rows())
        ck, cv = map(np.array, lane.store.read_rows())
        # Packed 4-/8-bit keys are dotted with int8-rounded queries (attention_reference.int8_queries).
        int8 = _ops.int8_queries()  # the extension's option; mx.fast's op (MLX_H2O_OPS=mlx) keeps float queries
        int8_keys = [int8 and bits[0] in (4, 8)] * T + [int8 and cfg.storage.kv_bits is not None] * cache.length
        ref, mass, _ = reference(mx.array(q), mx.array(np.concatenate([ak, ck], 2)), mx.array(np.concatenate([av, cv], 2)), scale,
                                 "causal" if L > 1 else None, None, np.array(int8_keys))
        np.testing.assert_allclose(np.array(out), ref, rtol=1e-4, atol=1e-4)
        mass = mass / L
        N = T + cache.length
        live = N - (L - 1) / 2
        upd = (lambda a, m: a + L * live * m) if cfg.scorer.score == "normalised" else (lambda a, m: a + L * m)
        np.testing.assert_allclose(np.array(column(cache, "acc")), upd(acc, mass[..., T:]), rtol=1e-4, atol=1e-6)
        if T:
            np.testing.assert_allclose(np.array(lane.archive.column("acc")), upd(arch_acc, mass[..., :T]), rtol=1e-4, atol=1e-6)
    # The archive holds evicted entries, quantized: each row is its original's packed copy.
    archive = cache.lanes[0].archive
    T = archive.length
    assert T == cache.lanes[0].archive_size and cache.evictions > 20
    pos = np.array(archive.column("pos"))
    held = np.array(column(cache, "pos"))
    ak, av = map(np.array, archive.read_rows())
    for b in range(B):
        for h in range(H):
            assert not set(pos[b, h]) & set(held[b, h]) and len(set(pos[b, h])) == T
            for i, p in enumerate(pos[b, h]):
                for got, orig, nb in ((ak, originals[b, h, p][0], bits[0]), (av, originals[b, h, p][1], bits[1])):
                    want = np.array(mx.dequantize(*mx.quantize(mx.array(orig[None]), group_size=32, bits=nb), group_size=32, bits=nb))[0]
                    if cfg.storage.kv_bits is None:
                        np.testing.assert_allclose(got[b, h, i], want, atol=1e-5)
                    else:  # packed twice (the cache's format, then the archive's): close to the original
                        assert np.abs(got[b, h, i] - orig).max() < 4 * np.abs(want - orig).max() + 0.05
    # Equal bytes: cache + archive hold no more than the plain cache of M entries (and nearly as much).
    assert 0.85 * plain.nbytes <= cache.nbytes <= plain.nbytes


def test_archive_options_and_budget_split():
    from mlx_h2o.caches.h2o.storage import row_bytes

    assert row_bytes(None, 64, 64, 32, 4) == 512 and row_bytes(2, 64, 64, 32, 4) == 64 and row_bytes((8, 4), 64, 64, 32, 4) == 128
    for bad, match in [(dict(merge=0.5), "merge"), (dict(evicted_share=0.99), "evicted_share")]:
        with pytest.raises(ValueError, match=match):
            H2OConfig.build(16, evicted_bits=4, **bad)
    model = tiny_model("llama", head_dim=32)
    cache = mlx_h2o.make_cache(model, "h2o", max_kv_size=256, evicted_bits=2, evicted_share=0.5)
    step_logits(model, tokens(20, batch=1), cache)
    # fp32 rows of 2 x 32 x 4 = 256 bytes (+ 8) against 2-bit rows of 2 x (8 + 8) = 32 (+ 8).
    assert cache[0].budget.max_kv_size == 128 and cache[0].lanes[0].archive_size == 128 * 264 // 40


def test_a_lane_that_keeps_every_entry_archives_nothing():
    """Per-head budgets: one head may keep all its entries while the others give up more; its lane's
    eviction then moves nothing to the archive and leaves the lane as it was."""
    from mlx_h2o.caches.h2o.lane import make_lanes

    config = H2OConfig.build(16, head_budget="adaptive", evicted_bits=2)
    lane = make_lanes(config, 0, 1, 2)[0]
    lane.archive_size, lane.row_dtype = 8, "float32"
    k, v = mx.random.normal((1, 1, 6, 32)), mx.random.normal((1, 1, 6, 32))
    lane.store.append(k, v, 8, acc=mx.ones((6,)), pos=mx.arange(6, dtype=mx.int32))
    idx = mx.arange(6, dtype=mx.int32)[None, None]
    config.keeper.evict(lane, idx, 6, 2, 8, config.scorer.rule, 6, False)
    assert lane.length == 6 and lane.archived == 0
    np.testing.assert_array_equal(np.array(lane.store.read_rows()[0]), np.array(k))
