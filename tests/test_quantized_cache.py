"""The "quantized" policy: mlx-lm's quantized storage attended by the fused packed-K/V kernel."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as lm_cache
from attention_reference import float_queries
from decoding import step_logits, tokens
from tiny_models import tiny_model

import mlx_h2o
from mlx_h2o import hook
from mlx_h2o.caches.quantized import FusedQuantizedKVCache


def _run(model, cache, x):
    """Every position's logits: a prefill of 20 tokens, then one token at a time."""
    return step_logits(model, x, cache, prefill=20, every_position=True)


@pytest.mark.parametrize("bits", [4, 8])
def test_fused_quantized_matches_mlx_lm_quantized_path(bits):
    model = tiny_model("llama", head_dim=64, hidden_size=128)
    x = tokens(60, seed=1, batch=1, vocab=101)
    with float_queries():  # the same arithmetic as mlx-lm's path (int8 queries: see test_quantized_attention)
        fused = _run(model, mlx_h2o.make_cache(model, "quantized", bits=bits, group_size=32), x)
    stock = _run(model, [lm_cache.QuantizedKVCache(group_size=32, bits=bits) for _ in model.layers], x)
    full = _run(model, mlx_h2o.make_cache(model, "full"), x)
    # Same packed K/V either way; mlx-lm dequantizes in the activations' dtype, the kernel in float32.
    np.testing.assert_allclose(fused, stock, atol=5e-3, rtol=1e-3)
    assert np.abs(fused - full).max() > 0  # the cache really is quantized


def test_more_bits_less_error():
    model = tiny_model("llama", head_dim=64, hidden_size=128)
    x = tokens(60, seed=1, batch=1, vocab=101)
    full = _run(model, mlx_h2o.make_cache(model, "full"), x)
    err = {b: np.abs(_run(model, mlx_h2o.make_cache(model, "quantized", bits=b, group_size=32), x) - full).max() for b in (4, 8)}
    assert err[8] < 0.2 * err[4], err


def test_opt_in_routes_mlx_lm_quantized_cache(monkeypatch):
    model = tiny_model("qwen3", head_dim=64, hidden_size=128)
    x = tokens(40, seed=2, batch=1, vocab=101)
    calls = []

    def counting(*args, **kwargs):
        calls.append(kwargs["bits"])
        return mlx_h2o.quantized_scaled_dot_product_attention_with_scores(*args, **kwargs)

    monkeypatch.setattr(hook, "quantized_scaled_dot_product_attention_with_scores", counting)
    stock = _run(model, [lm_cache.QuantizedKVCache(group_size=64, bits=8) for _ in model.layers], x)
    mlx_h2o.use_fast_cpu_attention(True)
    try:
        with float_queries():
            fused = _run(model, [lm_cache.QuantizedKVCache(group_size=64, bits=8) for _ in model.layers], x)
    finally:
        mlx_h2o.use_fast_cpu_attention(None)
    assert calls and set(calls) == {8}
    np.testing.assert_allclose(fused, stock, atol=5e-3, rtol=1e-3)


def test_nbytes_counts_packed_live_tokens():
    model = tiny_model("llama", head_dim=64, hidden_size=128)
    cache = mlx_h2o.make_cache(model, "quantized", bits=4, group_size=64)
    _run(model, cache, mx.arange(30)[None])
    n, heads, dim = 30, 2, 64  # tokens, kv heads, head dim of the tiny model
    per_token = 2 * heads * (dim * 4 // 8 + 2 * (dim // 64) * 4)  # K and V: packed nibbles + f32 scale, bias
    assert all(c.nbytes == n * per_token for c in cache)
    assert all(isinstance(c, FusedQuantizedKVCache) for c in cache)


def test_save_load_reproduces_generation(tmp_path):
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    model = tiny_model("llama", head_dim=64, hidden_size=128)
    x = tokens(30, seed=3, batch=1, vocab=101)
    cache = mlx_h2o.make_cache(model, "quantized", bits=8)
    _run(model, cache, x)
    save_prompt_cache(str(tmp_path / "c.safetensors"), cache)
    loaded = load_prompt_cache(str(tmp_path / "c.safetensors"))
    assert all(type(c) is FusedQuantizedKVCache for c in loaded)
    nxt = mx.array([[5]])
    np.testing.assert_array_equal(np.array(model(nxt, cache=cache)), np.array(model(nxt, cache=loaded)))


def test_bad_options():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="bits must be one of"):
        mlx_h2o.make_cache(model, "quantized", bits=3)
    with pytest.raises(ValueError, match="group_size must be one of"):
        mlx_h2o.make_cache(model, "quantized", group_size=16)
    with pytest.raises(ValueError, match="unknown option"):
        mlx_h2o.make_cache(model, "quantized", max_kv_size=16)
