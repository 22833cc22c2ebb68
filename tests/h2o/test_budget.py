"""The budget of the h2o cache (caches/h2o/budget.py, spread.py): keep counts, one selection per
layer, layer budgets (pyramid, dispersion by attention entropy) and adaptive per-head budgets."""

import mlx.core as mx
import numpy as np
import pytest
from decoding import lockstep, step_logits, tokens
from tiny_models import tiny_model

import mlx_h2o
from mlx_h2o.caches.h2o import H2OConfig, H2OKVCache

from .references import column, head_lengths, kept_positions


# ----------------------------------------------------------------------------- one selection per layer
def test_shared_selection_keeps_one_set_per_layer():
    model = tiny_model("llama")
    cache = mlx_h2o.make_cache(model, "h2o", max_kv_size=20, select="layer")
    step_logits(model, tokens(80, batch=2), cache)
    for c in cache:
        pos = np.array(column(c, "pos"))
        assert (pos == pos[:, :1]).all()
    cache = mlx_h2o.make_cache(model, "h2o", max_kv_size=20)
    step_logits(model, tokens(80, batch=2), cache)
    assert any((np.array(column(c, "pos")) != np.array(column(c, "pos")[:, :1])).any() for c in cache)


# ----------------------------------------------------------------------------- budgets per layer
def test_layer_budget_splits_keep_the_total():
    from mlx_h2o.caches.h2o.spread import MIN_LAYER_FRACTION, layer_budgets, pyramid_weights, split_total

    cfg = H2OConfig.build(64).budget
    for weights in ([1.0] * 5, pyramid_weights(7), [0.1, 5.0, 2.0, 0.0, 3.3, 1.0], [4.6, 1.9, 3.0]):
        budgets = layer_budgets(cfg, weights)
        assert sum(budgets) == 64 * len(weights) and min(budgets) >= MIN_LAYER_FRACTION * 64
        # Above the floor, budgets follow the weights.
        order = np.argsort(weights, kind="stable")
        assert all(budgets[a] <= budgets[b] for a, b in zip(order, order[1:]))
    assert layer_budgets(cfg, [1.0] * 4) == [64] * 4
    assert split_total(10, [1, 1, 1], 2) in ([4, 3, 3], [3, 4, 3], [3, 3, 4])
    with pytest.raises(ValueError, match="cannot give"):
        split_total(5, [1, 1, 1], 2)


def test_attention_entropy_matches_numpy():
    from mlx_h2o.caches.h2o.spread import attention_entropy

    mass = np.random.default_rng(0).random((2, 3, 17)).astype(np.float32) ** 4
    p = mass / mass.sum(-1, keepdims=True)
    assert attention_entropy(mx.array(mass)).item() == pytest.approx((-(p * np.log(p)).sum(-1)).mean(), rel=1e-5)


@pytest.mark.parametrize("layer_budget", ["pyramid", "dispersion"])
def test_layer_budgets_keep_the_uniform_total(layer_budget):
    from mlx_h2o.caches.h2o.spread import layer_budgets, pyramid_weights

    model = tiny_model("llama", num_hidden_layers=4)
    M = 24
    cache = mlx_h2o.make_cache(model, "h2o", max_kv_size=M, layer_budget=layer_budget)
    step_logits(model, tokens(90, seed=9, batch=2), cache)
    budgets = [c.layer_budget.max_kv_size for c in cache]
    assert sum(budgets) == 4 * M and len(set(budgets)) > 1
    for c in cache:
        assert c.size() <= c.layer_budget.max_kv_size and c.evictions > 0 and c.budget_allocated
        assert c.layer_budget.recent == H2OConfig.build(M).budget.recent or c.layer_budget.heavy == 0  # the window keeps its size
    if layer_budget == "pyramid":
        assert budgets == layer_budgets(H2OConfig.build(M).budget, pyramid_weights(4)) and budgets[0] > budgets[-1]
    else:
        g = cache[0].budget_group
        entropy = [e / n for e, n in zip(g.entropy, g.calls)]
        assert budgets == layer_budgets(H2OConfig.build(M).budget, entropy) and min(g.calls) > 0
        # Saved and loaded, a layer keeps its budget.
        again = H2OKVCache.from_state(cache[1].state, cache[1].meta_state)
        assert again.config == cache[1].config and again.budget_allocated


def test_layer_budget_dispersion_needs_mass_scores():
    with pytest.raises(ValueError, match="dispersion"):
        H2OConfig.build(16, layer_budget="dispersion", score="logit_ema")


# ----------------------------------------------------------------------------- budgets per head
def _np_adaptive(prio, protected, valid, keep_total, heavy):
    from mlx_h2o.caches.h2o.spread import ADAKV_FLOOR

    B, H, C = prio.shape
    floor = int(np.ceil(ADAKV_FLOOR * heavy))
    out = np.zeros(prio.shape, bool)
    for b in range(B):
        forced = protected[b] & valid[b]
        for h in range(H):
            open_ = [j for j in range(C) if valid[b, h, j] and not protected[b, h, j]]
            for j in sorted(open_, key=lambda j: -prio[b, h, j])[:floor]:
                forced[h, j] = True
        rest = sorted(((h, j) for h in range(H) for j in range(C) if valid[b, h, j] and not forced[h, j]), key=lambda t: -prio[b][t])
        out[b] = forced
        for t in rest[: keep_total - forced.sum()]:
            out[b][t] = True
    return out


@pytest.mark.parametrize("seed", range(4))
def test_adaptive_head_selection_matches_numpy(seed):
    from mlx_h2o.caches.h2o.spread import adaptive_head_selection

    rng = np.random.default_rng(seed)
    B, H, C = 2, 3, 40
    lengths = rng.integers(25, C + 1, (B, H))
    valid = np.arange(C)[None, None] < lengths[..., None]
    prio = rng.random((B, H, C)).astype(np.float32) * rng.choice([0.1, 1, 10], (1, H, 1))  # heads differ in scale
    protected = valid & (rng.random((B, H, C)) < 0.15)
    keep = int(valid.sum(axis=(1, 2)).min()) - 12
    got = np.array(adaptive_head_selection(mx.array(prio), mx.array(protected), mx.array(valid), keep, heavy=10))
    np.testing.assert_array_equal(got, _np_adaptive(prio, protected, valid, keep, 10))
    assert (got.sum(axis=(1, 2)) == keep).all() and not (got & ~valid).any() and (got | ~protected).all()


@pytest.mark.parametrize("options", [dict(), dict(evict_every=3), dict(evict_every=2, kv_bits=8), dict(chunk=4, layer_budget="pyramid")])
def test_adaptive_heads_equal_full_cache_masked_per_head(options):
    model = tiny_model("llama", head_dim=32)
    x = tokens(130, seed=11, batch=2)
    cache = mlx_h2o.make_cache(model, "h2o", max_kv_size=24, head_budget="adaptive", **options)
    if "kv_bits" in options:  # packed rows are a quantized copy of what a reference would see
        step_logits(model, x, cache)
    else:
        assert lockstep(model, x, cache, kept_positions(cache), chunk_at=(60, 100)) < 1e-4
    for c in cache:
        n, M = head_lengths(c), c.layer_budget.max_kv_size
        assert len(c.lanes) == 2 * 2  # a lane per (batch row, kv head)
        assert (n.sum(axis=1) <= 2 * M).all() and c.evictions > 10  # 2 kv heads, never more than M each on average
        # No padding stored: the K/V bytes are exactly the rows the heads hold (+ 8 bytes of score and position).
        row = 2 * 32 * (4 if "kv_bits" not in options else 1 + 2 * 4 / 32)
        assert c.nbytes == pytest.approx(n.sum() * (row + 8))
    assert any(len(set(head_lengths(c).ravel())) > 1 for c in cache)  # heads really differ


def test_adaptive_heads_reject_what_they_cannot_do():
    with pytest.raises(ValueError, match="adaptive"):
        H2OConfig.build(16, head_budget="adaptive", select="layer")
    model = tiny_model("llama")
    cache = mlx_h2o.make_cache(model, "h2o", max_kv_size=16, head_budget="adaptive")
    assert cache[0].make_mask(4, return_array=True).shape == (4, 4)  # nothing held yet: one mask serves all heads
    step_logits(model, tokens(60, batch=2), cache)
    ragged = [c for c in cache if len(set(head_lengths(c).ravel())) > 1]
    assert ragged
    with pytest.raises(ValueError, match="mask"):
        ragged[0].make_mask(4, return_array=True)
