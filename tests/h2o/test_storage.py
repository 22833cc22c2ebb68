"""The h2o cache's storage: K/V rows packed at low bits (one format, or older / recent tiers) and
rotated before packing; evictions move packed rows untouched. (tests/test_storage.py tests
src/mlx_h2o/storage itself.)"""

import mlx.core as mx
import numpy as np
import pytest
from attention_reference import float_queries
from attention_reference import reference as float64_attention
from decoding import greedy, step_logits, tokens
from mlx_lm.generate import generate_step
from mlx_lm.models import cache as lm_cache
from tiny_models import tiny_model

import mlx_h2o
from mlx_h2o.caches.h2o import H2OKVCache

from .references import column


def _layer0_full_kv(model, x):
    """Layer 0's keys and values for every position of x. They depend on the tokens and positions
    only (not on what the cache keeps), so every cache's layer 0 must store exactly these rows
    (computed with the same call schedule, so the floats agree to the bit)."""
    full = mlx_h2o.make_cache(model, "full")
    step_logits(model, x, full)
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
    _check_kept_rows(kv_bits, rotate)


@pytest.mark.parametrize("kv_recent_rows", [1, 4, 9])
def test_a_short_recent_tier_keeps_the_same_positions_quantized(kv_recent_rows):
    """kv_recent_rows: only the newest rows stay 8-bit, the rest of the recent window (and every heavy
    hitter) is 4-bit, each row exactly as the tiers quantize it."""
    _check_kept_rows("4/8", True, kv_recent_rows=kv_recent_rows)


def _check_kept_rows(kv_bits, rotate, **options):
    model = tiny_model("llama", head_dim=32)
    x = tokens(120, seed=11, batch=2)
    M, group = 24, 32
    cache = mlx_h2o.make_cache(model, "h2o", max_kv_size=M, evict_every=3, kv_bits=kv_bits, rotate=rotate, **options)
    step_logits(model, x, cache)
    c = cache[0]
    assert c.evictions > 10 and c.offset == 120
    K, V = _layer0_full_kv(model, x)
    rows = c.lanes[0].store.inner  # under the per-entry columns
    store = rows.inner if rotate else rows
    if rotate:  # every write rotates its rows as rotation.keys does (float64 sums, rounded once)
        rotation = rows.rotation
        K, V = rotation.keys(K), rotation.values(V)
    low, high = c.config.storage.tiers()
    pos = column(c, "pos")
    if low == high:
        parts = [(store, pos, None)]
    else:
        parts = [(store.low, pos[..., : store.low.length], None), (store.high, pos[..., store.low.length :], None)]
        # the recent window (or its newest kv_recent_rows) stays high, with up to `slack` rows more before they demote
        assert store.window == c.config.storage.high_rows(c.budget.recent)
        assert store.window <= store.high.length <= store.window + store.slack
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
    x = tokens(100, seed=12, batch=1)
    # Errors without eviction (M > length): once entries are evicted, a slightly different score
    # changes which entries stay, and a tiny random model amplifies that.
    ref = step_logits(model, x, mlx_h2o.make_cache(model, "h2o", max_kv_size=128))
    errors = {}
    for kv_bits in (8, "mixed", 4):
        cache = mlx_h2o.make_cache(model, "h2o", max_kv_size=128, kv_bits=kv_bits)
        errors[kv_bits] = np.abs(step_logits(model, x, cache) - ref).mean()
    assert errors[8] < errors["mixed"] < errors[4] < 0.05 * np.abs(ref).max()
    M = 32
    sizes = {}
    for kv_bits in (None, 8, "mixed", 4):
        cache = mlx_h2o.make_cache(model, "h2o", max_kv_size=M, kv_bits=kv_bits)
        step_logits(model, x, cache)
        sizes[kv_bits] = cache[0].lanes[0].store.inner.nbytes()  # the rows, without their columns
    # Per row and kv head: K and V, head_dim values at (bits/8 bytes + 2 fp32 (scale, bias) per 32).
    per_row = lambda bits: 2 * 32 * (bits / 8) + 2 * 2 * 4  # noqa: E731  (one group of 32 per head row)
    H = cache[0].lanes[0].store.inner.k.arrays[0].shape[1]
    assert sizes[None] == 2 * H * M * 32 * 4  # fp32 tiny model
    assert sizes[8] == H * M * per_row(8) and sizes[4] == H * M * per_row(4)
    assert sizes[4] < sizes["mixed"] < sizes[8] < sizes[None]


def test_low_bit_caches_save_load_and_trim(tmp_path):
    model = tiny_model("llama", head_dim=32)
    prompt = tokens(40, seed=13)
    for opts in (dict(kv_bits="mixed"), dict(kv_bits=4, rotate=True)):
        cache = mlx_h2o.make_cache(model, "h2o", max_kv_size=24, evict_every=2, **opts)
        for last, _ in generate_step(prompt, model, max_tokens=20, prompt_cache=cache):
            pass
        path = str(tmp_path / "h2o_lowbit.safetensors")
        lm_cache.save_prompt_cache(path, cache)
        loaded = lm_cache.load_prompt_cache(path)
        assert loaded[0].nbytes == cache[0].nbytes

        np.testing.assert_array_equal(greedy(model, loaded, last, 12)[1], greedy(model, cache, last, 12)[1])
        # Trimming the recent window drops rows from the newest tier first.
        n = cache[0].length
        assert [c.trim(3) for c in cache] == [3, 3]
        assert cache[0].length == n - 3 == cache[0].lanes[0].store.length


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(kv_bits=5), r"kv_bits must be one of '8', '4', '8/4', '4/8', '8/fp', '4/fp', 'k8v4', 'k4v8', 'k8v4/8', 'k8v4/fp', 'mixed'"),
        (dict(kv_bits="4/2"), r"kv_bits must be one of '8', '4'"),
        (dict(kv_group_size=48), r"kv_group_size must be one of 32, 64, 128"),
        (dict(rotate="yes"), "rotate must be True or False"),
        (dict(rotate=True, rotate_lam="calibrated"), r"rotate_lam must be one of 'none', 'prefill'"),
        (dict(kv_bits="4", kv_recent_rows=8), r"kv_recent_rows needs two formats in kv_bits \(OLDER/RECENT, e.g. 4/8\), got kv_bits='4'"),
        (dict(kv_bits="4/8", kv_recent_rows=0), r"kv_recent_rows must be an integer >= 1"),
        (dict(kv_bits="4", kv_sink_rows=4), r"kv_sink_rows needs two formats in kv_bits \(OLDER/RECENT, e.g. 4/8\), got kv_bits='4'"),
        (dict(center_keys=True), r"center_keys needs two formats in kv_bits \(OLDER/RECENT, e.g. 4/8\), got kv_bits=None"),
        (dict(kv_bits="4/8", center_keys=True, evicted_bits=2), r"center_keys does not combine with an archive of evicted entries \(evicted_bits\)"),
    ],
)
def test_bad_low_bit_options_raise_value_error(options, match):
    with pytest.raises(ValueError, match=match):
        mlx_h2o.make_cache(tiny_model("llama"), "h2o", max_kv_size=64, **options)


def test_low_bit_rows_need_head_dim_divisible_by_group():
    model = tiny_model("llama")  # head_dim 16
    cache = mlx_h2o.make_cache(model, "h2o", max_kv_size=16, kv_bits=4, kv_group_size=32)
    with pytest.raises(ValueError, match="kv_group_size"):
        model(tokens(8, batch=1), cache=cache)


def test_two_tiers_demote_a_batch_of_rows_per_slack_tokens():
    """The high tier takes `slack` rows beyond its window before demoting (WindowTieredKV): decode
    steps write into room it has, it demotes once every `slack` tokens, the newest `window` rows are
    always high-tier, and the rows demoted are those a store demoting one row a token demotes."""
    from mlx_h2o.caches.h2o.storage import WindowTieredKV

    window, slack = 6, 4
    batched, single = WindowTieredKV(4, 8, window, slack=slack), WindowTieredKV(4, 8, window)
    rng = np.random.default_rng(0)
    demotions, capacity = 0, None
    for t in range(40):
        k, v = (mx.array(rng.standard_normal((1, 2, 1, 32)).astype(np.float32)) for _ in range(2))
        before = batched.high.length
        for store in (batched, single):
            store.append(k, v, 64)
        demotions += batched.high.length < before
        if t >= window + slack:
            assert window <= batched.high.length <= window + slack
            assert batched.high.k.capacity == capacity or batched.high.length == window + 1  # regrown only after a batch
        capacity = batched.high.k.capacity
        assert batched.length == single.length == t + 1
        n = batched.low.length
        if n:
            for got, want in zip(batched.low.read_rows(), single.low.read_rows()):
                np.testing.assert_array_equal(np.array(got), np.array(want[:, :, :n]))
    assert demotions == (40 - window - 1) // slack


@pytest.mark.parametrize("arch, lam", [("llama", "none"), ("gpt_oss", "none"), ("gpt_oss", "prefill")])
def test_centred_keys_attend_as_their_rows_say(arch, lam):
    """Keys stored less their mean: one more query through each layer equals float64 attention over
    the rows read back (the mean added back), with a model's learned attention sinks too (their logit
    is not shifted: the cache adds q . c back to the others), whether the op rotates the query or
    the storage does (a λ scale)."""
    model = tiny_model(arch, head_dim=32)
    options = dict(kv_bits="4/8", rotate=True, rotate_lam=lam, center_keys=True, kv_sink_rows=2, kv_recent_rows=4)
    cache = mlx_h2o.make_cache(model, "h2o", max_kv_size=24, evict_every=2, **options)
    step_logits(model, tokens(40, seed=3, batch=2), cache)
    rng = np.random.default_rng(4)
    for c in (c for c in cache if isinstance(c, H2OKVCache)):
        store = c.lanes[0].store
        assert store.key_center() is not None and c.evictions > 0
        B, H = c.shape
        Hq, D = model.args.num_attention_heads, c.head_dims[0]
        q = mx.array(rng.standard_normal((B, Hq, 1, D)).astype(np.float32))
        sinks = mx.array(rng.standard_normal((Hq,)).astype(np.float32)) if arch == "gpt_oss" else None
        with float_queries():
            got = np.array(c.attend(q, *store.fetch(), scale=D**-0.5, sinks=sinks))
        keys, values = store.read_rows()
        out, _, _ = float64_attention(store.prepare_queries(q), keys, values, D**-0.5, sinks=sinks)
        want = np.array(store.restore_output(mx.array(out.astype(np.float32)), q.dtype))
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
