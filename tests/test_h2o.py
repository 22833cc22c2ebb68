"""The h2o policy: eviction and scoring against NumPy references, the evicted layout against a
full cache masked to the kept positions, and mlx-lm integration on tiny models of many architectures."""

import copy
import warnings

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models import cache as lm_cache
from attention_reference import reference
from tiny_models import CONFIGS, tiny_model

import mlx_h2o
from mlx_h2o import _ops, hook
from mlx_h2o.caches.h2o import H2OConfig, H2OKVCache
from mlx_h2o.caches.h2o.eviction import keep_count
from mlx_h2o.storage import role_bits

VOCAB = CONFIGS["llama"]["vocab_size"]


def _h2o_layers(cache):
    return [c for c in cache if isinstance(c, H2OKVCache)]


def _tokens(n, seed=0, batch=None):
    shape = (n,) if batch is None else (batch, n)
    return mx.array(np.random.default_rng(seed).integers(0, VOCAB, shape))


def _step_logits(model, x, cache, prefill=8):
    """Last-position logits after a prefill of `prefill` tokens, then after each following token."""
    out = [model(x[:, :prefill], cache=cache)[:, -1]]
    mx.eval(out[-1])
    for i in range(prefill, x.shape[1]):
        out.append(model(x[:, i : i + 1], cache=cache)[:, -1])
        mx.eval(out[-1])
    return np.array(mx.stack(out, axis=1).astype(mx.float32))


def _greedy_logits(model, cache, token, steps):
    """Logits of `steps` greedy steps from `token` (a generation continued from a cache)."""
    y, out = mx.array([token]), []
    for _ in range(steps):
        logits = model(y[None], cache=cache)[0, -1]
        y = mx.argmax(logits, keepdims=True)
        out.append(np.array(logits))
    return np.stack(out)


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


def _np_attention(q, k, v, scale, sinks=None):
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


def _np_update(cfg, acc, q, k, v, scale, L, w, pool):
    B, Hq, _, _ = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G = Hq // Hkv
    rows = slice(L - w, L) if (w and L > w) else slice(0, L)
    n_rows = rows.stop - rows.start
    out, p, logits = _np_attention(q, k, v, scale)
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
    cfg = H2OConfig.build(16, **options)
    cache = H2OKVCache(cfg)
    rng = np.random.default_rng(sum(map(ord, repr(options))))
    B, Hkv, G, D = 2, 2, 3, 8
    scale = D**-0.5
    ref_keys = {}  # (b, h, position) -> key vector
    q_mean = q_sq = None  # running query statistics (expected attention)
    evicted = 0
    for L in SCHEDULE:
        before = (np.array(cache.acc[..., : cache.length]), np.array(cache.positions[..., : cache.length])) if cache.length else None
        content = None
        if before is not None and (cfg.expected or cfg.redundancy):
            held = np.stack([[[ref_keys[b, h, p] for p in before[1][b, h]] for h in range(Hkv)] for b in range(B)])
            content = (held, q_mean, np.maximum(q_sq - q_mean**2, 0), scale)
        k = rng.standard_normal((B, Hkv, L, D)).astype(np.float32)
        v = rng.standard_normal((B, Hkv, L, D)).astype(np.float32)
        offset = cache.offset
        keys, values = cache.update_and_fetch(mx.array(k), mx.array(v))
        pos = np.array(cache.positions[..., : cache.length])
        new = np.broadcast_to(np.arange(offset, offset + L), (B, Hkv, L))
        if before is not None:
            kept = _np_keep(cfg, *before, offset, L, content)
            evicted += kept.shape[-1] < before[1].shape[-1]
            np.testing.assert_array_equal(pos, np.concatenate([kept, new], axis=-1))
        assert cache.length <= cfg.max_kv_size + cfg.pinned_before(cache.offset) or L > 1
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
        acc = np.array(cache.acc[..., : cache.length])
        out = cache.attend(mx.array(q), keys, values, scale=scale, mask="causal" if L > 1 else None)
        ref_out, ref_acc = _np_update(cfg, acc, q, kk, np.array(values), scale, L, cfg.obs_window, cfg.obs_pool)
        np.testing.assert_allclose(np.array(out), ref_out, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(np.array(cache.acc[..., : cache.length]), ref_acc, rtol=2e-4, atol=1e-6)
    assert evicted > 10
    for a, b in cfg.pin:
        assert all(set(range(a, b)) <= set(row) for row in np.array(cache.positions[..., : cache.length]).reshape(-1, cache.length))


# ----------------------------------------------------------------------------- the evicted layout
class KeptPositionsReference(lm_cache.KVCache):
    """A full cache whose attention is masked to the positions its twin h2o cache holds: what the
    h2o layer must compute if keys, values, RoPE positions and the mask are all right."""

    def __init__(self, twin):
        super().__init__()
        self.twin = twin

    def attend(self, queries, keys, values, *, scale, mask=None, sinks=None):
        N, L = keys.shape[2], queries.shape[2]
        # (B, Hc, n); per-head budgets keep a padded rectangle whose empty slots never match a position.
        held = self.twin.positions if hasattr(self.twin, "head_lengths") else self.twin.positions[..., : self.twin.length]
        held = (mx.arange(N)[None, None, :, None] == held[:, :, None, :]).any(axis=-1)  # (B, Hc, N)
        allowed = held[:, :, None, :] & (mx.arange(N)[None, :] <= mx.arange(N - L, N)[:, None])
        allowed = mx.repeat(allowed, queries.shape[1] // allowed.shape[1], axis=1)
        if isinstance(mask, mx.array) and mask.dtype != mx.bool_:
            allowed = mx.where(allowed, mask, -mx.inf)  # MLA: the mask carries the RoPE part of the logits
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=allowed, sinks=sinks)


class SeedOffsetBug(H2OKVCache):
    """The MLX seed's bug: the logical offset reset to the physical length after eviction."""

    def _evict(self, keep, capacity):
        super()._evict(keep, capacity)
        self.offset = self.length


def _lockstep(model, x, cache, prefill=8, chunk_at=()):
    """Run the h2o cache and its masked full-cache twin side by side; max |logit difference|."""
    ref = [KeptPositionsReference(c) if isinstance(c, H2OKVCache) else copy.deepcopy(c) for c in cache]
    worst, i = 0.0, prefill
    a, b = model(x[:, :prefill], cache=cache), model(x[:, :prefill], cache=ref)
    while i < x.shape[1]:
        worst = max(worst, float(mx.abs(a[:, -1] - b[:, -1]).max()))
        n = 6 if i in chunk_at else 1
        a = model(x[:, i : i + n], cache=cache)
        mx.eval(a)
        b = model(x[:, i : i + n], cache=ref)
        worst = max(worst, float(mx.abs(a - b).max()))
        i += n
    return worst


def test_evicted_layout_equals_full_cache_masked_to_kept_positions():
    model = tiny_model("llama")
    x = _tokens(140, seed=3, batch=2)
    cache = mlx_h2o.make_cache(model, "h2o", max_kv_size=24, evict_every=3)
    # Multi-row calls after eviction exercise the causal mask over the evicted layout.
    assert _lockstep(model, x, cache, chunk_at=(60, 100)) < 1e-4
    c = cache[0]
    assert c.offset == 140 and c.length <= 24 + 2 and c.evictions > 10


def test_seed_offset_reset_bug_cannot_happen():
    model = tiny_model("llama")
    x = _tokens(100, seed=4, batch=1)
    cfg = H2OConfig.build(24)
    cache = [H2OKVCache(cfg) for _ in model.layers]
    assert _lockstep(model, x, cache) < 1e-4
    for c in cache:
        assert c.offset == 100 and c.size() == 24  # logical position vs physical length
        planned = keep_count(c.config, c.length, c.offset, 4)
        assert c.make_mask(4, return_array=True).shape == (4, (c.length if planned is None else planned) + 4)
    # The same check catches the seed's bug: its offset falls back to the physical length.
    buggy = [SeedOffsetBug(cfg) for _ in model.layers]
    assert _lockstep(model, x, buggy) > 1e-2


@pytest.mark.parametrize("select", ["head", "layer"])
def test_batch_sequences_are_evicted_independently(select):
    model = tiny_model("qwen3")
    x = _tokens(120, seed=5, batch=3)
    opts = dict(max_kv_size=20, select=select, evict_every=2)
    batched = _step_logits(model, x, mlx_h2o.make_cache(model, "h2o", **opts))
    for b in range(3):
        alone = _step_logits(model, x[b : b + 1], mlx_h2o.make_cache(model, "h2o", **opts))
        np.testing.assert_allclose(batched[b : b + 1], alone, atol=1e-4)


def test_shared_selection_keeps_one_set_per_layer():
    model = tiny_model("llama")
    cache = mlx_h2o.make_cache(model, "h2o", max_kv_size=20, select="layer")
    _step_logits(model, _tokens(80, batch=2), cache)
    for c in cache:
        pos = np.array(c.positions[..., : c.length])
        assert (pos == pos[:, :1]).all()
    cache = mlx_h2o.make_cache(model, "h2o", max_kv_size=20)
    _step_logits(model, _tokens(80, batch=2), cache)
    assert any((np.array(c.positions[..., : c.length]) != np.array(c.positions[:, :1, : c.length])).any() for c in cache)


# ----------------------------------------------------------------------------- architectures
@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_architecture_generates_with_bounded_cache(arch):
    model = tiny_model(arch)
    M, e = 64, 4
    cache = mlx_h2o.make_cache(model, "h2o", max_kv_size=M, evict_every=e)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tokens = [t for t, _ in generate_step(_tokens(20, seed=1), model, max_tokens=300, prompt_cache=cache)]
    assert len(tokens) == 300
    layers = _h2o_layers(cache)
    assert layers and all(c.peak <= M and c.evictions > 0 for c in layers)
    assert all(c.offset >= 20 + 299 for c in layers)  # generate_step runs one step ahead
    # Sliding-window layers keep their own cache.
    kinds = {type(c).__name__ for c in cache}
    assert kinds == ({"H2OKVCache", "RotatingKVCache"} if arch in ("gemma3", "gpt_oss") else {"H2OKVCache"})
    inline = arch == "gemma2"  # mlx-lm's gemma2 attends inline: no scores, a warned fallback
    assert all(c.scoreless == inline for c in layers)
    assert any("no attention scores" in str(w.message) for w in caught) == inline

    # Nothing evicted (M >= length): the same logits as the model's own cache.
    x = _tokens(70, seed=2, batch=2)
    full = _step_logits(model, x, mlx_h2o.make_cache(model, "full"))
    h2o = _step_logits(model, x, mlx_h2o.make_cache(model, "h2o", max_kv_size=128))
    np.testing.assert_allclose(h2o, full, atol=1e-4 * max(1.0, np.abs(full).max()))


@pytest.mark.parametrize("arch", ["deepseek_v3", "gpt_oss", "gemma3"])
def test_mla_sinks_and_sliding_layers_match_masked_reference(arch):
    model = tiny_model(arch)
    cache = mlx_h2o.make_cache(model, "h2o", max_kv_size=20, evict_every=2)
    assert _lockstep(model, _tokens(80, seed=6, batch=2), cache, chunk_at=(40,)) < 1e-4
    assert all(c.evictions > 10 for c in _h2o_layers(cache))


def test_long_prompt_prefilled_in_chunks_stays_bounded():
    # The bound holds from the second chunk on, whatever the length (benchmarks/bench_h2o.py runs 32K).
    model = tiny_model("llama")
    M, chunk, n = 64, 256, 8192
    cache = mlx_h2o.make_cache(model, "h2o", max_kv_size=M)
    prompt = _tokens(n, seed=7)
    steps = generate_step(prompt, model, max_tokens=4, prompt_cache=cache, prefill_step_size=chunk)
    assert len(list(steps)) == 4
    for c in _h2o_layers(cache):
        # A chunk is appended whole after an eviction down to M - evict_every.
        assert c.offset >= n + 3 and c.peak == M - c.config.evict_every + chunk and c.size() <= M


def test_pinned_spans_are_never_evicted():
    model = tiny_model("llama")
    M, e, span = 24, 4, (3, 13)
    cache = mlx_h2o.make_cache(model, "h2o", max_kv_size=M, evict_every=e, pin=[span])
    _step_logits(model, _tokens(150, seed=8, batch=2), cache)
    for c in cache:
        pos = np.array(c.positions[..., : c.length])
        assert all(set(range(*span)) <= set(row) for row in pos.reshape(-1, c.length))
        assert c.peak <= M + (span[1] - span[0])
    assert mlx_h2o.make_cache(model, "h2o", max_kv_size=M, pin="3:13;40:50")[0].config.pin == ((3, 13), (40, 50))


def test_reset_and_trim():
    model = tiny_model("llama")
    x = _tokens(60, seed=9, batch=1)
    cache = mlx_h2o.make_cache(model, "h2o", max_kv_size=16)
    assert hook.installed()
    first = _step_logits(model, x, cache)
    for c in cache:
        c.reset()
        assert c.empty() and c.offset == 0 and c.size() == 0
    np.testing.assert_array_equal(_step_logits(model, x, cache), first)
    # Trim the last 3 tokens (held: they are in the recent window); a longer trim stops where the
    # held tail of consecutive positions ends.
    c0 = cache[0]
    assert c0.is_trimmable() and [c.trim(3) for c in cache] == [3, 3] and c0.offset == 57
    pos = np.array(c0.positions[..., : c0.length])
    assert pos.max() == 56 and c0.length == 13
    run = next(k for k in range(1, 14) if not (pos[..., -k:] == np.arange(57 - k, 57)).all()) - 1
    assert c0.trim(100) == run and c0.offset == 57 - run and c0.length == 13 - run


@pytest.mark.skipif(hook.MLX_LM_CALLS_ATTEND, reason="the patched mlx-lm calls cache.attend itself: there is no hook to remove")
def test_without_the_hook_the_cache_falls_back():
    model = tiny_model("llama")
    x = _tokens(60, seed=9, batch=1)
    mlx_h2o.make_cache(model, "h2o", max_kv_size=16)
    assert hook.installed()
    # With the hook removed the model never reaches attend(): the cache says so and falls back.
    fallback = [H2OKVCache(H2OConfig.build(16)) for _ in model.layers]
    hook.remove()
    try:
        cache = mlx_h2o.make_cache(model, "rotating", max_kv_size=16)
        assert not hook.installed()  # other policies do not install it
        with pytest.warns(RuntimeWarning, match="no attention scores"):
            _step_logits(model, x, fallback)
        assert all(c.scoreless for c in fallback)
    finally:
        hook.install()
    # The hook is a no-op for other caches.
    full_hooked = _step_logits(model, x, mlx_h2o.make_cache(model, "full"))
    hook.remove()
    full_plain = _step_logits(model, x, mlx_h2o.make_cache(model, "full"))
    hook.install()
    np.testing.assert_array_equal(full_hooked, full_plain)


def test_save_load_round_trip_reproduces_generation(tmp_path):
    model = tiny_model("llama")
    prompt = _tokens(40, seed=10)
    cache = mlx_h2o.make_cache(model, "h2o", max_kv_size=24, evict_every=4, score="ema", pin=[(2, 5)])
    last = None
    for last, _ in generate_step(prompt, model, max_tokens=20, prompt_cache=cache):
        pass
    path = str(tmp_path / "h2o.safetensors")
    lm_cache.save_prompt_cache(path, cache, metadata={"note": "h2o"})
    hook.remove()
    loaded, meta = lm_cache.load_prompt_cache(path, return_metadata=True)
    assert hook.installed() and meta == {"note": "h2o"}
    assert [type(c) for c in loaded] == [H2OKVCache] * len(cache)
    for a, b in zip(cache, loaded):
        assert (a.offset, a.length, a.config) == (b.offset, b.length, b.config)

    np.testing.assert_array_equal(_greedy_logits(model, loaded, last, 30), _greedy_logits(model, cache, last, 30))


def _generate_alone(model, prompt, steps, **options):
    cache = mlx_h2o.make_cache(model, "h2o", **options)
    out = []
    for y, _ in generate_step(mx.array(prompt), model, max_tokens=steps, prompt_cache=cache):
        out.append(int(y))
    return out


def test_batch_generator_equals_each_sequence_alone():
    """mlx-lm's BatchGenerator (continuous batching, as batch_generate and the server use it):
    prompts of different lengths (right-padded together), sequences that finish early (filter)
    and join late (extend); each sequence's tokens equal its own generation, and the finished
    sequences' caches (extract) held at most the budget."""
    from mlx_lm.generate import BatchGenerator

    model = tiny_model("llama")
    M = 24
    prompts = [np.random.default_rng(20 + i).integers(0, VOCAB, n).tolist() for i, n in enumerate((40, 9, 70, 33))]
    steps = [30, 12, 25, 40]
    want = [_generate_alone(model, p, n, max_kv_size=M, evict_every=3) for p, n in zip(prompts, steps)]
    gen = BatchGenerator(model, stop_tokens=[], prefill_batch_size=3, completion_batch_size=3)
    caches = [mlx_h2o.make_cache(model, "h2o", max_kv_size=M, evict_every=3) for _ in prompts]
    uids = gen.insert(prompts[:3], steps[:3], caches=caches[:3])
    got, finished, late = {u: [] for u in uids}, {}, None
    while len(finished) < len(prompts):
        for r in gen.next_generated():
            got.setdefault(r.uid, []).append(r.token)
            if r.finish_reason is not None:
                finished[r.uid] = r.prompt_cache
        if late is None and finished:  # a fourth request joins while the others decode
            late = gen.insert(prompts[3:], steps[3:], caches=caches[3:])[0]
    gen.close()
    assert [got[u] for u in uids + [late]] == want
    for cache in finished.values():
        assert all(isinstance(c, H2OKVCache) and c.size() <= min(M + 2, c.offset) for c in cache)
    assert sorted(max(c.offset for c in cache) for cache in finished.values()) == sorted(len(p) + n for p, n in zip(prompts, steps))


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(split="wide"), r"split must be one of 'heavy', 'balanced', 'recent', 'explicit', got 'wide'"),
        (dict(score="lru"), r"score must be one of 'cumulative', 'ema', 'logit_ema', 'normalised'"),
        (dict(select="token"), r"select must be one of 'head', 'layer'"),
        (dict(evict_every=0), r"evict_every must be an integer >= 1"),
        (dict(evict_every=61), r"evict_every must be an integer in \[1, 60\]"),
        (dict(sink=64), r"sink must be an integer in \[0, 63\]"),
        (dict(split="explicit", heavy=10), "split='explicit' needs heavy and recent"),
        (dict(split="explicit", heavy=10, recent=10), "sink \\+ heavy \\+ recent must equal max_kv_size=64"),
        (dict(heavy=10), "give split='explicit'"),
        (dict(score="cumulative", decay=0.9), "decay applies to score in"),
        (dict(score="ema", decay=1.5), r"decay must be a number in \[0.0, 1.0\)"),
        (dict(pin=[(5, 2)]), "pin must be"),
        (dict(pin="a:b"), "pin must be START:END"),
        (dict(obs_window=-1), "obs_window must be"),
        (dict(pool=0), r"pool must be an integer >= 1"),
        (dict(budget=3), r"unknown option\(s\) budget for policy 'h2o'; its options: max_kv_size, split"),
        (dict(max_kv_size=0), "max_kv_size must be an integer >= 1"),
    ],
)
def test_bad_options_raise_value_error(options, match):
    model = tiny_model("llama")
    options = {"max_kv_size": 64, **options}
    with pytest.raises(ValueError, match=match):
        mlx_h2o.make_cache(model, "h2o", **options)


@pytest.mark.parametrize("pool", [1, 3, 5])
def test_pooled_priority_keeps_the_neighbours_of_a_heavy_hitter(pool):
    from mlx_h2o.caches.h2o import eviction_plan

    config = H2OConfig.build(16, split="explicit", sink=2, heavy=pool * 2, recent=14 - pool * 2, score="cumulative", pool=pool)
    P = 40
    acc = mx.random.uniform(0, 1, (1, 2, P), key=mx.random.key(pool))
    acc[:, 0, 17] = 100.0  # head 0: one heavy hitter; head 1: random scores only
    positions = mx.broadcast_to(mx.arange(P, dtype=mx.int32), (1, 2, P))
    keep = 15
    recent = keep - config.sink - config.heavy
    idx = eviction_plan(config, False)(acc, positions, mx.array(P, mx.int32), mx.array(P - recent, mx.int32), keep, 16)
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


def test_eval_spec_and_presets():
    from mlx_h2o.evaluation.runner import parse_specs

    spec = parse_specs(["h2o:score=ema,split=balanced"], [128])[0]
    assert spec.options == {"max_kv_size": 128, "score": "ema", "split": "balanced"}
    cfg = H2OConfig.build(256)
    assert (cfg.sink, cfg.heavy, cfg.recent) == (4, 128, 124)
    assert (H2OConfig.build(256, split="balanced").heavy, H2OConfig.build(256, split="recent").heavy) == (64, 32)


# ----------------------------------------------------------------------------- low-bit storage
def _layer0_full_kv(model, x):
    """Layer 0's keys and values for every position of x. They depend on the tokens and positions
    only (not on what the cache keeps), so every cache's layer 0 must store exactly these rows
    (computed with the same call schedule, so the floats agree to the bit)."""
    full = mlx_h2o.make_cache(model, "full")
    _step_logits(model, x, full)
    return full[0].keys[..., : x.shape[1], :], full[0].values[..., : x.shape[1], :]


def _rows_at(x, positions):
    return mx.take_along_axis(x, positions[..., None], axis=2)


def _encode(x, bits, group):
    return [x] if bits is None else list(mx.quantize(x, group_size=group, bits=bits))


@pytest.mark.parametrize("kv_bits", [8, 4, "mixed", "8/4", "4/fp", "8/fp"])
@pytest.mark.parametrize("rotate", [False, True])
def test_low_bit_rows_are_the_kept_positions_quantized(kv_bits, rotate):
    """Evicting packed rows moves them untouched: after many evictions, layer 0's stored rows are
    exactly quantize(rotate(K)) at the kept positions, per tier (older rows: heavy bits; the recent
    window: recent bits; a row demoted from 8 to 4 bits is quantized from its 8-bit value)."""
    model = tiny_model("llama", head_dim=32)
    x = _tokens(120, seed=11, batch=2)
    M, group = 24, 32
    cache = mlx_h2o.make_cache(model, "h2o", max_kv_size=M, evict_every=3, kv_bits=kv_bits, rotate=rotate)
    _step_logits(model, x, cache)
    c = cache[0]
    assert c.evictions > 10 and c.offset == 120
    K, V = _layer0_full_kv(model, x)
    store = c.store.inner if rotate else c.store
    if rotate:  # rows rotated in the calls they arrived in (prefill 8, then one by one)
        chunks = [(0, 8)] + [(i, i + 1) for i in range(8, 120)]
        rotation = c.store.rotation
        K = mx.concatenate([rotation.keys(K[:, :, a:b]) for a, b in chunks], axis=2)
        V = mx.concatenate([rotation.values(V[:, :, a:b]) for a, b in chunks], axis=2)
    low, high = c.config.tiers()
    pos = c.positions[..., : c.length]
    if low == high:
        parts = [(store, pos, None)]
    else:
        parts = [(store.low, pos[..., : store.low.length], None), (store.high, pos[..., store.low.length :], None)]
        assert store.high.length == c.config.recent  # the recent window stays in the high tier
    for part, p, _ in parts:
        bits = part.k.bits
        for row_store, X in ((part.k, K), (part.v, V)):
            want = _rows_at(X, p)
            if part is not store and part is store.low and high is not None and bits is not None:
                # Demoted rows went through the high tier's format first.
                want = mx.dequantize(*mx.quantize(want, group_size=group, bits=high), group_size=group, bits=high).astype(X.dtype)
            got = row_store.state(part.length)
            for g, w in zip(got, _encode(want, bits, group)):
                np.testing.assert_array_equal(np.array(g), np.array(w))


def test_low_bit_caches_track_the_dense_cache_and_shrink():
    model = tiny_model("llama", head_dim=32)
    x = _tokens(100, seed=12, batch=1)
    # Errors without eviction (M > length): once entries are evicted, a slightly different score
    # changes which entries stay, and a tiny random model amplifies that.
    ref = _step_logits(model, x, mlx_h2o.make_cache(model, "h2o", max_kv_size=128))
    errors = {}
    for kv_bits in (8, "mixed", 4):
        cache = mlx_h2o.make_cache(model, "h2o", max_kv_size=128, kv_bits=kv_bits)
        errors[kv_bits] = np.abs(_step_logits(model, x, cache) - ref).mean()
    assert errors[8] < errors["mixed"] < errors[4] < 0.05 * np.abs(ref).max()
    M = 32
    sizes = {}
    for kv_bits in (None, 8, "mixed", 4):
        cache = mlx_h2o.make_cache(model, "h2o", max_kv_size=M, kv_bits=kv_bits)
        _step_logits(model, x, cache)
        sizes[kv_bits] = cache[0].store.nbytes()
    # Per row and kv head: K and V, head_dim values at (bits/8 bytes + 2 fp32 (scale, bias) per 32).
    per_row = lambda bits: 2 * 32 * (bits / 8) + 2 * 2 * 4  # noqa: E731  (one group of 32 per head row)
    H = cache[0].store.k.arrays[0].shape[1]
    assert sizes[None] == 2 * H * M * 32 * 4  # fp32 tiny model
    assert sizes[8] == H * M * per_row(8) and sizes[4] == H * M * per_row(4)
    assert sizes[4] < sizes["mixed"] < sizes[8] < sizes[None]


def test_low_bit_caches_save_load_and_trim(tmp_path):
    model = tiny_model("llama", head_dim=32)
    prompt = _tokens(40, seed=13)
    for opts in (dict(kv_bits="mixed"), dict(kv_bits=4, rotate=True)):
        cache = mlx_h2o.make_cache(model, "h2o", max_kv_size=24, evict_every=2, **opts)
        for last, _ in generate_step(prompt, model, max_tokens=20, prompt_cache=cache):
            pass
        path = str(tmp_path / "h2o_lowbit.safetensors")
        lm_cache.save_prompt_cache(path, cache)
        loaded = lm_cache.load_prompt_cache(path)
        assert loaded[0].store.nbytes() == cache[0].store.nbytes()

        np.testing.assert_array_equal(_greedy_logits(model, loaded, last, 12), _greedy_logits(model, cache, last, 12))
        # Trimming the recent window drops rows from the newest tier first.
        n = cache[0].length
        assert [c.trim(3) for c in cache] == [3, 3]
        assert cache[0].length == n - 3 == cache[0].store.length


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(kv_bits=5), r"kv_bits must be one of '8', '4', '8/4', '4/8', '8/fp', '4/fp', 'k8v4', 'k4v8', 'k8v4/8', 'k8v4/fp', 'mixed'"),
        (dict(kv_bits="4/2"), r"kv_bits must be one of '8', '4'"),
        (dict(kv_group_size=48), r"kv_group_size must be one of 32, 64, 128"),
        (dict(rotate="yes"), "rotate must be True or False"),
        (dict(rotate=True, rotate_lam="calibrated"), r"rotate_lam must be one of 'none', 'prefill'"),
    ],
)
def test_bad_low_bit_options_raise_value_error(options, match):
    with pytest.raises(ValueError, match=match):
        mlx_h2o.make_cache(tiny_model("llama"), "h2o", max_kv_size=64, **options)


def test_low_bit_rows_need_head_dim_divisible_by_group():
    model = tiny_model("llama")  # head_dim 16
    cache = mlx_h2o.make_cache(model, "h2o", max_kv_size=16, kv_bits=4, kv_group_size=32)
    with pytest.raises(ValueError, match="kv_group_size"):
        model(_tokens(8, batch=1), cache=cache)


def test_16k_decode_soak_holds_a_bounded_number_of_entries():
    """16,384 tokens decoded one at a time through h2o(M=256): the entries held never pass the
    budget (benchmarks/bench_h2o.py --soak records the process RSS of the same run)."""
    model = tiny_model("llama", num_hidden_layers=1)
    M, steps = 256, 16384
    cache = mlx_h2o.make_cache(model, "h2o", max_kv_size=M)
    y = _tokens(32, seed=13, batch=1)
    for i in range(steps // 64):
        for _ in range(64):
            y = mx.argmax(model(y, cache=cache)[:, -1:], axis=-1)
        mx.eval(y, [c.acc for c in cache])
        assert all(c.size() <= M for c in cache), i
    assert all(c.offset == 32 + steps - 1 and c.peak <= M and c.evictions >= (steps - M) // c.config.evict_every for c in cache)


# ----------------------------------------------------------------------------- budgets per layer
def test_layer_budget_splits_keep_the_total():
    from mlx_h2o.caches.h2o.budgets import MIN_LAYER_FRACTION, layer_budgets, pyramid_weights, split_total

    cfg = H2OConfig.build(64)
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
    from mlx_h2o.caches.h2o.budgets import attention_entropy

    mass = np.random.default_rng(0).random((2, 3, 17)).astype(np.float32) ** 4
    p = mass / mass.sum(-1, keepdims=True)
    assert attention_entropy(mx.array(mass)).item() == pytest.approx((-(p * np.log(p)).sum(-1)).mean(), rel=1e-5)


@pytest.mark.parametrize("layer_budget", ["pyramid", "dispersion"])
def test_layer_budgets_keep_the_uniform_total(layer_budget):
    from mlx_h2o.caches.h2o.budgets import layer_budgets, pyramid_weights

    model = tiny_model("llama", num_hidden_layers=4)
    M = 24
    cache = mlx_h2o.make_cache(model, "h2o", max_kv_size=M, layer_budget=layer_budget)
    _step_logits(model, _tokens(90, seed=9, batch=2), cache)
    budgets = [c.config.max_kv_size for c in cache]
    assert sum(budgets) == 4 * M and len(set(budgets)) > 1
    for c in cache:
        assert c.size() <= c.config.max_kv_size and c.evictions > 0 and c.budget_allocated
        assert c.config.recent == H2OConfig.build(M).recent or c.config.heavy == 0  # the window keeps its size
    if layer_budget == "pyramid":
        assert budgets == layer_budgets(H2OConfig.build(M), pyramid_weights(4)) and budgets[0] > budgets[-1]
    else:
        g = cache[0].budget_group
        entropy = [e / n for e, n in zip(g.entropy, g.calls)]
        assert budgets == layer_budgets(H2OConfig.build(M), entropy) and min(g.calls) > 0
        # Saved and loaded, a layer keeps its budget.
        again = H2OKVCache.from_state(cache[1].state, cache[1].meta_state)
        assert again.config == cache[1].config and again.budget_allocated


def test_layer_budget_dispersion_needs_mass_scores():
    with pytest.raises(ValueError, match="dispersion"):
        H2OConfig.build(16, layer_budget="dispersion", score="logit_ema")


# ----------------------------------------------------------------------------- budgets per head
def _np_adaptive(prio, protected, valid, keep_total, heavy):
    from mlx_h2o.caches.h2o.budgets import ADAKV_FLOOR

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
    from mlx_h2o.caches.h2o.budgets import adaptive_head_selection

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
    from mlx_h2o.caches.h2o import AdaptiveHeadsKVCache

    model = tiny_model("llama", head_dim=32)
    x = _tokens(130, seed=11, batch=2)
    cache = mlx_h2o.make_cache(model, "h2o", max_kv_size=24, head_budget="adaptive", **options)
    assert all(isinstance(c, AdaptiveHeadsKVCache) for c in cache)
    if "kv_bits" in options:  # packed rows are a quantized copy of what a reference would see
        _step_logits(model, x, cache)
    else:
        assert _lockstep(model, x, cache, chunk_at=(60, 100)) < 1e-4
    for c in cache:
        n = c.head_lengths
        M = c.config.max_kv_size
        assert (n.sum(axis=1) <= 2 * M).all() and c.evictions > 10  # 2 kv heads, never more than M each on average
        assert (c.store.lengths == n).all()
        # No padding stored: the K/V bytes are exactly the rows the heads hold.
        row = 2 * 32 * (4 if "kv_bits" not in options else 1 + 2 * 4 / 32)
        assert c.store.nbytes() == pytest.approx(n.sum() * row)
    assert any(len(set(c.head_lengths.ravel())) > 1 for c in cache)  # heads really differ


def test_adaptive_heads_reject_what_they_cannot_do():
    for bad in (dict(select="layer"), dict(obs_window=4), dict(expected=0.5), dict(redundancy=0.5), dict(rotate=True)):
        with pytest.raises(ValueError, match="adaptive"):
            H2OConfig.build(16, head_budget="adaptive", **bad)
    model = tiny_model("llama")
    cache = mlx_h2o.make_cache(model, "h2o", max_kv_size=16, head_budget="adaptive")
    assert cache[0].make_mask(4, return_array=True).shape == (4, 4)  # nothing held yet: one mask serves all heads
    _step_logits(model, _tokens(60, batch=2), cache)
    ragged = [c for c in cache if len(set(c.head_lengths.ravel())) > 1]
    assert ragged
    with pytest.raises(ValueError, match="mask"):
        ragged[0].make_mask(4, return_array=True)


# ----------------------------------------------------------------------------- keep, don't drop
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
    from mlx_h2o.caches.h2o.eviction import merge_evicted

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
        ref, _, _ = _np_attention(q, k_all[:, :, : t + 1], v_all[:, :, : t + 1], D**-0.5)
        # While the held entries are the distinct tokens seen so far, each with its count (nothing was
        # dropped or blended with a different key), attention must be exact.
        held, mult = np.array(keys), np.array(cache.mult[..., : cache.length])
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
    _step_logits(model, _tokens(90, seed=12, batch=2), cache)
    for c in cache:
        np.testing.assert_allclose(np.array(c.mult[..., : c.length]).sum(axis=-1), 90)  # every token is in some entry
    # A threshold no pair of keys reaches merges nothing: plain h2o.
    plain = _step_logits(model, _tokens(90, seed=12, batch=2), mlx_h2o.make_cache(model, "h2o", max_kv_size=20, evict_every=2))
    never = _step_logits(model, _tokens(90, seed=12, batch=2), mlx_h2o.make_cache(model, "h2o", max_kv_size=20, evict_every=2, merge=0.99999))
    np.testing.assert_allclose(never, plain, atol=1e-5)
    with pytest.raises(ValueError, match="one storage format"):
        H2OConfig.build(16, merge=0.5, kv_bits="mixed")


# ----------------------------------------------------------------------------- evicted entries at low bits
@pytest.mark.parametrize("options", [dict(evicted_bits=4), dict(evicted_bits="k8v4", evicted_share=0.25, score="cumulative"),
                                     dict(evicted_bits=2, kv_bits=8, evict_every=3)])
def test_archive_attends_over_both_tiers_at_equal_bytes(options):
    from mlx_h2o.caches.h2o import ArchiveKVCache

    cfg = H2OConfig.build(16, **options)
    cache = ArchiveKVCache(cfg)
    plain = H2OKVCache(H2OConfig.build(16, **{k: v for k, v in options.items() if not k.startswith("evicted")}))
    rng = np.random.default_rng(len(repr(options)))
    B, H, G, D = 2, 2, 2, 32
    scale = D**-0.5
    bits = role_bits(cfg.evicted_format())
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
        T = cache.archive.length
        arch_acc = None if not T else np.array(cache.archive_acc[..., :T])
        acc = np.array(cache.acc[..., : cache.length])
        out = cache.attend(mx.array(q), *own, scale=scale, mask="causal" if L > 1 else None)
        plain.attend(mx.array(q), keys, values, scale=scale, mask="causal" if L > 1 else None)
        ak, av = (np.zeros((B, H, 0, D), np.float32),) * 2 if not T else map(np.array, cache.archive.read_rows())
        ck, cv = map(np.array, cache.store.read_rows())
        # Packed 4-/8-bit keys are dotted with int8-rounded queries (attention_reference.int8_queries).
        int8 = _ops.int8_queries()  # the extension's option; mx.fast's op (MLX_H2O_OPS=mlx) keeps float queries
        int8_keys = [int8 and bits[0] in (4, 8)] * T + [int8 and cfg.kv_bits is not None] * cache.length
        ref, mass, _ = reference(mx.array(q), mx.array(np.concatenate([ak, ck], 2)), mx.array(np.concatenate([av, cv], 2)), scale,
                                 "causal" if L > 1 else None, None, np.array(int8_keys))
        np.testing.assert_allclose(np.array(out), ref, rtol=1e-4, atol=1e-4)
        mass = mass / L
        N = T + cache.length
        live = N - (L - 1) / 2
        upd = (lambda a, m: a + L * live * m) if cfg.score == "normalised" else (lambda a, m: a + L * m)
        np.testing.assert_allclose(np.array(cache.acc[..., : cache.length]), upd(acc, mass[..., T:]), rtol=1e-4, atol=1e-6)
        if T:
            np.testing.assert_allclose(np.array(cache.archive_acc[..., :T]), upd(arch_acc, mass[..., :T]), rtol=1e-4, atol=1e-6)
    # The archive holds evicted entries, quantized: each row is its original's packed copy.
    T = cache.archive.length
    assert T == cache.archive_size and cache.evictions > 20
    pos = np.array(cache.archive_positions[..., :T])
    held = np.array(cache.positions[..., : cache.length])
    ak, av = map(np.array, cache.archive.read_rows())
    for b in range(B):
        for h in range(H):
            assert not set(pos[b, h]) & set(held[b, h]) and len(set(pos[b, h])) == T
            for i, p in enumerate(pos[b, h]):
                for got, orig, nb in ((ak, originals[b, h, p][0], bits[0]), (av, originals[b, h, p][1], bits[1])):
                    want = np.array(mx.dequantize(*mx.quantize(mx.array(orig[None]), group_size=32, bits=nb), group_size=32, bits=nb))[0]
                    if cfg.kv_bits is None:
                        np.testing.assert_allclose(got[b, h, i], want, atol=1e-5)
                    else:  # packed twice (the cache's format, then the archive's): close to the original
                        assert np.abs(got[b, h, i] - orig).max() < 4 * np.abs(want - orig).max() + 0.05
    # Equal bytes: cache + archive hold no more than the plain cache of M entries (and nearly as much).
    assert 0.85 * plain.nbytes <= cache.nbytes <= plain.nbytes


def test_archive_options_and_budget_split():
    from mlx_h2o.caches.h2o.archive import row_bytes

    assert row_bytes(None, 64, 64, 32, 4) == 512 and row_bytes(2, 64, 64, 32, 4) == 64 and row_bytes((8, 4), 64, 64, 32, 4) == 128
    for bad, match in [(dict(merge=0.5), "merge"), (dict(head_budget="adaptive"), "adaptive"), (dict(layer_budget="pyramid"), "layer_budget"),
                       (dict(evicted_share=0.99), "evicted_share")]:
        with pytest.raises(ValueError, match=match):
            H2OConfig.build(16, evicted_bits=4, **bad)
    model = tiny_model("llama", head_dim=32)
    cache = mlx_h2o.make_cache(model, "h2o", max_kv_size=256, evicted_bits=2, evicted_share=0.5)
    _step_logits(model, _tokens(20, batch=1), cache)
    # fp32 rows of 2 x 32 x 4 = 256 bytes (+ 8) against 2-bit rows of 2 x (8 + 8) = 32 (+ 8).
    assert cache[0].config.max_kv_size == 128 and cache[0].archive_size == 128 * 264 // 40
