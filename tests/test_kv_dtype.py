"""`kv_dtype`: the full, rotating and h2o caches store their K/V rows in a narrower dtype than the
model computes in (float16 halves a float32 model's cache, as llama.cpp's f16 cache does), and the
fused kernel reads them as they are."""

import copy

import mlx.core as mx
import numpy as np
import pytest
from attention_reference import check, randn, random_mask
from decoding import step_logits, tokens
from mlx.utils import tree_map_with_path
from mlx_lm.models import cache as lm_cache

import mlx_h2o
from mlx_h2o import hook, storage
from mlx_h2o.attention import scaled_dot_product_attention_with_scores
from mlx_h2o.caches.baseline import FUSED_CLASSES
from tiny_models import tiny_model

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16}


@pytest.mark.parametrize("kv_dtype", list(DTYPES))
@pytest.mark.parametrize("mask", [None, "causal", "bool"])
def test_float32_queries_over_narrower_rows_match_the_float64_reference(kv_dtype, mask):
    rng = np.random.default_rng(5)
    B, Hq, Hkv, L, N, D = 2, 9, 3, 4, 301, 64
    q = randn(rng, (B, Hq, L, D), mx.float32)
    k, v = (randn(rng, (B, Hkv, N, D), DTYPES[kv_dtype]) for _ in range(2))
    check(q, k, v, D**-0.5, random_mask(rng, mask, B, Hq, L, N))
    # The dense path the caches take (MLX's own SDPA where the fork makes it the fused kernel).
    out = hook.fused_dense_attention(q, k, v, scale=D**-0.5, mask=None)
    want = scaled_dot_product_attention_with_scores(q, k.astype(mx.float32), v.astype(mx.float32), scale=D**-0.5)[0]
    assert out.dtype == mx.float32
    np.testing.assert_allclose(np.array(out), np.array(want), atol=1e-6, rtol=1e-5)


def rounded(dtype, *rows):
    """Each of `rows` rounded to `dtype` and widened back: the values narrower rows hold, in the rows' dtype."""
    return tuple(a.astype(dtype).astype(a.dtype) for a in rows)


class Rounded:
    """The reference: a cache holding its rows rounded to `dtype` and widened back."""

    dtype = mx.float16

    def update_and_fetch(self, keys, values):
        return super().update_and_fetch(*rounded(self.dtype, keys, values))


# On the fused caches of the policies (attended by the same kernel, with no process-wide opt-in).
ROUNDED = {cls: type(f"Rounded{fused.__name__}", (Rounded, fused), {}) for cls, fused in FUSED_CLASSES.items()}


def rounded_caches(model):
    hook.install()
    caches = lm_cache.make_prompt_cache(model)
    for c in caches:
        c.__class__ = ROUNDED[type(c)]
    return caches


@pytest.mark.parametrize("kv_dtype", list(DTYPES))
@pytest.mark.parametrize("model_type", ["llama", "gemma3"])
def test_full_stores_rows_in_kv_dtype_with_the_logits_of_rounded_rows(kv_dtype, model_type, monkeypatch):
    model = tiny_model(model_type)
    x = tokens(300, seed=1, batch=1, vocab=101)  # past mlx-lm's 256-row buffer step: the buffer grows once
    cache = mlx_h2o.make_cache(model, "full", kv_dtype=kv_dtype)
    got = step_logits(model, x, cache, prefill=260)
    assert all(c.keys.dtype == DTYPES[kv_dtype] and c.values.dtype == DTYPES[kv_dtype] for c in cache)
    monkeypatch.setattr(Rounded, "dtype", DTYPES[kv_dtype])
    # The same kernel over float32 rows holding the rounded values (gemma3: its sliding layers too).
    want = step_logits(model, x, rounded_caches(model), prefill=260)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    # Narrower than float32's by more than the kernel's error: the rows really were rounded.
    exact = step_logits(model, x, mlx_h2o.make_cache(model, "full"), prefill=260)
    assert np.abs(exact - want).max() > 10 * np.abs(got - want).max()


def test_full_halves_the_bytes_and_keeps_its_dtype_when_copied_saved_and_loaded(tmp_path):
    model = tiny_model("llama")
    x = tokens(40, seed=2, batch=1, vocab=101)
    wide, narrow = mlx_h2o.make_cache(model, "full"), mlx_h2o.make_cache(model, "full", kv_dtype="float16")
    for c in (wide, narrow):
        step_logits(model, x, c, prefill=30)
    assert sum(c.nbytes for c in narrow) * 2 == sum(c.nbytes for c in wide)
    twin = copy.deepcopy(narrow)
    path = str(tmp_path / "c.safetensors")
    lm_cache.save_prompt_cache(path, narrow)
    loaded = lm_cache.load_prompt_cache(path)
    more = tokens(260, seed=3, batch=1, vocab=101)  # grows the buffer: a widening concatenate would show
    outs = [step_logits(model, more, c, prefill=1) for c in (narrow, twin, loaded)]
    for c in (narrow, twin, loaded):
        assert c[0].keys.dtype == mx.float16 and c[0].values.dtype == mx.float16
    np.testing.assert_array_equal(outs[1], outs[0])
    np.testing.assert_array_equal(outs[2], outs[0])


@pytest.mark.parametrize("kv_dtype", list(DTYPES))
def test_h2o_keeps_the_entries_and_logits_of_rounded_rows_at_half_the_bytes(kv_dtype, monkeypatch):
    """Dense h2o rows in kv_dtype: the kernel scores and attends them as float32 rows holding the
    rounded values, so the same entries are evicted and the logits are the same."""
    from mlx_h2o.caches.h2o.cache import H2OKVCache
    from mlx_h2o.evaluation import kv_bytes

    model = tiny_model("llama")
    x = tokens(90, seed=6, batch=1, vocab=101)
    narrow = mlx_h2o.make_cache(model, "h2o", max_kv_size=24, kv_dtype=kv_dtype)
    got = step_logits(model, x, narrow, prefill=40)
    assert all(c.row_dtype == kv_dtype and c.evictions > 0 for c in narrow)
    original = H2OKVCache.update_and_fetch
    monkeypatch.setattr(H2OKVCache, "update_and_fetch",
                        lambda self, k, v: original(self, *rounded(DTYPES[kv_dtype], k, v)))
    wide = mlx_h2o.make_cache(model, "h2o", max_kv_size=24)
    want = step_logits(model, x, wide, prefill=40)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    for a, b in zip(narrow, wide):
        np.testing.assert_array_equal(np.array(a.lanes[0].store.column("pos")), np.array(b.lanes[0].store.column("pos")))
    assert kv_bytes(narrow) < 0.55 * kv_bytes(wide)


def test_rotating_stores_rows_in_kv_dtype():
    model = tiny_model("llama")
    cache = mlx_h2o.make_cache(model, "rotating", max_kv_size=24, kv_dtype="bfloat16")
    step_logits(model, tokens(60, seed=4, batch=1, vocab=101), cache, prefill=30)
    assert all(c.keys.dtype == mx.bfloat16 and c.size() == 24 for c in cache)


@pytest.mark.parametrize("policy", [dict(policy="full"), dict(policy="h2o", max_kv_size=24)])
@pytest.mark.parametrize("value", ["int8", "float64", 16, "fp16"])
def test_a_bad_kv_dtype_is_a_clear_error(value, policy):
    with pytest.raises(ValueError, match="kv_dtype must be one of 'float16', 'bfloat16', 'float32'"):
        mlx_h2o.make_cache(tiny_model("llama"), **policy, kv_dtype=value)


@pytest.mark.default_kv_dtype
@pytest.mark.parametrize("model_dtype, stored", [(mx.float32, mx.float16), (mx.bfloat16, mx.bfloat16), (mx.float16, mx.float16)])
def test_unset_kv_dtype_halves_a_float32_models_rows_and_keeps_16_bit_rows_as_they_come(model_dtype, stored):
    model = tiny_model("llama")
    model.set_dtype(model_dtype)
    x = tokens(60, seed=7, batch=1, vocab=101)
    full = mlx_h2o.make_cache(model, "full")
    rotating = mlx_h2o.make_cache(model, "rotating", max_kv_size=24)
    h2o = mlx_h2o.make_cache(model, "h2o", max_kv_size=24)
    for cache in (full, rotating, h2o):
        step_logits(model, x, cache, prefill=30)
    assert all(c.keys.dtype == stored and c.values.dtype == stored for c in full + rotating)
    assert all(c.row_dtype == str(stored).split(".")[-1] for c in h2o)
    # Asked for, float32 rows stay as mlx-lm keeps them.
    wide = mlx_h2o.make_cache(model, "full", kv_dtype="float32")
    step_logits(model, x, wide, prefill=30)
    assert all(c.keys.dtype == mx.float32 for c in wide)


@pytest.mark.default_kv_dtype
def test_a_quantized_models_dtype_is_its_layers_not_its_scales():
    """A GGUF keeps float16 scales and biases beside float32 norms, and its layers compute in float32."""
    import mlx.nn as nn

    model = tiny_model("llama", head_dim=64, hidden_size=128, intermediate_size=256)
    nn.quantize(model, group_size=32, bits=4)
    model.update(tree_map_with_path(lambda path, p: p.astype(mx.float16) if path.endswith(("scales", "biases")) else p,
                                    model.parameters()))
    assert storage.model_dtype(model) == mx.float32 and storage.default_kv_dtype(model) == "float16"
    model.set_dtype(mx.bfloat16)
    assert storage.model_dtype(model) == mx.bfloat16 and storage.default_kv_dtype(model) is None
