"""The opt-in fused CPU attention for every mlx-lm model: same logits as mlx-lm's stock attention."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as lm_cache

import mlx_h2o
from mlx_h2o import hook
from tiny_models import tiny_model


def _logits(model, tokens, fused):
    mlx_h2o.use_fast_cpu_attention(fused)
    try:
        cache = lm_cache.make_prompt_cache(model)
        x = mx.array(tokens)[None]
        outs = [model(x[:, :20], cache=cache)]  # prefill with a causal mask
        for t in range(20, len(tokens)):  # then decode, one token at a time
            outs.append(model(x[:, t : t + 1], cache=cache))
        return np.array(mx.concatenate(outs, axis=1))
    finally:
        mlx_h2o.use_fast_cpu_attention(False)


@pytest.mark.parametrize(
    "model_type,extra",
    [
        ("llama", {}),
        ("qwen3", {}),
        ("gpt_oss", {}),
    ],
)
def test_fused_attention_matches_stock(model_type, extra, monkeypatch):
    model = tiny_model(model_type, **extra)
    tokens = np.random.default_rng(0).integers(0, 101, 40).tolist()
    calls = []

    def counting(*args, **kwargs):
        calls.append(kwargs.get("sinks") is not None)
        return mlx_h2o.scaled_dot_product_attention_with_scores(*args, **kwargs)

    monkeypatch.setattr(hook, "scaled_dot_product_attention_with_scores", counting)
    stock = _logits(model, tokens, fused=False)
    assert not calls
    fused = _logits(model, tokens, fused=True)
    assert len(calls) == 2 * (len(tokens) - 20 + 1)  # every layer, every call went through the kernel
    assert all(calls) == (model_type == "gpt_oss")
    np.testing.assert_allclose(fused, stock, atol=2e-4, rtol=1e-4)


def test_hook_is_removable_and_off_by_default():
    assert not hook.fast_cpu_attention_enabled()
    mlx_h2o.use_fast_cpu_attention(True)
    assert hook.fast_cpu_attention_enabled()
    mlx_h2o.use_fast_cpu_attention(False)
    hook.remove()
    assert not hook.installed()
