"""The fused CPU attention for every mlx-lm model: opt-in for mlx-lm's caches made by other code, the
default for every policy's caches (full and rotating included); same logits as mlx-lm's stock
attention."""

import numpy as np
import pytest
from decoding import step_logits, tokens
from mlx_lm.models import cache as lm_cache

import mlx_h2o
from mlx_h2o import hook
from tiny_models import tiny_model


def _logits(model, x, fused):
    mlx_h2o.use_fast_cpu_attention(fused)
    try:
        # A prefill with a causal mask, then decode, one token at a time.
        return step_logits(model, x, lm_cache.make_prompt_cache(model), prefill=20, every_position=True)
    finally:
        mlx_h2o.use_fast_cpu_attention(None)


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
    x = tokens(40, seed=0, batch=1, vocab=101)
    calls = []

    real = hook.fused_dense_attention

    def counting(*args, **kwargs):
        calls.append(kwargs.get("sinks") is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(hook, "fused_dense_attention", counting)
    stock = _logits(model, x, fused=False)
    assert not calls
    fused = _logits(model, x, fused=True)
    assert len(calls) == 2 * (x.shape[1] - 20 + 1)  # every layer, every call went through the kernel
    assert all(calls) == (model_type == "gpt_oss")
    np.testing.assert_allclose(fused, stock, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("policy,options", [("full", {}), ("rotating", {"max_kv_size": 24})])
def test_baseline_policies_attend_with_the_fused_kernel_by_default(policy, options, monkeypatch, tmp_path):
    """`full` and `rotating` attend with the fused kernel with no opt-in, in every layer of a model
    with sliding and global layers (gemma3: the model's own RotatingKVCache layers too), with mlx-lm's
    logits; saved and loaded by mlx-lm's own functions, the caches keep the kernel and decode on."""
    from mlx_h2o.caches.baseline import FusedAttention
    from mlx_h2o.cpu_layers import mlx_has_layer_kernels

    model = tiny_model("gemma3")
    x = tokens(40, seed=1, batch=1, vocab=101)
    assert not hook.fast_cpu_attention_enabled() and hook.baseline_attention_fused()
    mlx_h2o.use_fast_cpu_attention(False)  # --attention stock: mlx-lm's path for these caches too
    try:
        stock = step_logits(model, x, mlx_h2o.make_cache(model, policy, **options), prefill=20, every_position=True)
    finally:
        mlx_h2o.use_fast_cpu_attention(None)
    calls = []
    real = hook.fused_dense_attention
    monkeypatch.setattr(hook, "fused_dense_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    cache = mlx_h2o.make_cache(model, policy, **options)
    assert all(isinstance(c, FusedAttention) for c in cache)
    fused = step_logits(model, x, cache, prefill=20, every_position=True)
    assert len(calls) == len(model.layers) * (x.shape[1] - 20 + 1)
    if not mlx_has_layer_kernels():  # the fork's MLX runs this kernel as its own SDPA
        assert np.abs(fused - stock).max() > 0  # two kernels: the comparison is not one path twice
    np.testing.assert_allclose(fused, stock, atol=2e-4, rtol=1e-4)
    path = str(tmp_path / "cache.safetensors")
    lm_cache.save_prompt_cache(path, cache)
    loaded = lm_cache.load_prompt_cache(path)
    assert [type(c) for c in loaded] == [type(c) for c in cache]
    y = x[:, -1:]
    np.testing.assert_array_equal(np.array(model(y, cache=loaded)), np.array(model(y, cache=cache)))


def test_mlx_lm_attention_inside_attend_does_not_call_attend_again():
    """A cache's fallback to mlx-lm's attention (its GPU path, `--attention stock`) hands mlx-lm a
    cache without `attend`: the patched mlx-lm calls `cache.attend` itself and would recurse. Dense:
    the same output as mlx-lm's attention over a plain cache."""
    import mlx.core as mx

    from mlx_h2o.caches.baseline import FusedKVCache
    from mlx_h2o.caches.quantized import FusedQuantizedKVCache

    q, k, v = (mx.random.normal((1, 2, n, 32), key=mx.random.key(i)) for i, n in enumerate((3, 7, 7)))
    mlx_h2o.use_fast_cpu_attention(False)  # the cache's attend falls back to mlx-lm's attention
    try:
        dense = np.array(hook.mlx_lm_attention(q, k, v, FusedKVCache(), 0.2, "causal"))
    finally:
        mlx_h2o.use_fast_cpu_attention(None)
    np.testing.assert_array_equal(dense, np.array(hook.mlx_lm_attention(q, k, v, lm_cache.KVCache(), 0.2, "causal")))
    # Quantized: mlx-lm's quantized attention itself (no attend) on the packed triples. (Not compared
    # with a second call: on this CPU mlx-lm's quantized path differs from call to call at these shapes.)
    qc = FusedQuantizedKVCache(group_size=32, bits=8)
    kq, vq = qc.update_and_fetch(k, v)
    out = np.array(hook.mlx_lm_attention(q, kq, vq, qc, 0.2, "causal"))
    assert out.shape == (1, 2, 3, 32) and np.isfinite(out).all()


def test_hook_is_removable_and_off_by_default():
    assert not hook.fast_cpu_attention_enabled()
    mlx_h2o.use_fast_cpu_attention(True)
    assert hook.fast_cpu_attention_enabled()
    mlx_h2o.use_fast_cpu_attention(False)
    assert not hook.baseline_attention_fused()
    mlx_h2o.use_fast_cpu_attention(None)
    assert hook.baseline_attention_fused()
    with pytest.raises(ValueError, match="True, False or None"):
        mlx_h2o.use_fast_cpu_attention("yes")
    hook.remove()
    assert hook.installed() == hook.MLX_LM_CALLS_ATTEND  # the patched mlx-lm calls attend itself


def test_mlx_lm_model_tests_pass_with_the_fused_attention(tmp_path):
    """mlx-lm's own tests/test_models.py (from its pinned sdist, scripts/series.py), once with
    mlx-lm's attention and once with the fused kernel as every model's attention (gradients
    included): every test that passes with mlx-lm's passes with ours. Both runs draw the same
    random weights (scripts/mlx_lm_suite.py seeds them). Both use MLX's own BLAS: with NumPy's
    OpenBLAS (mlx_h2o.use_openblas(), which this suite opts in to) a GEMM's rounding depends on its row count, which fails
    test_gemma3n_kv_shared_layers_ignore_chunking's bitwise whole-vs-chunked comparison whatever the
    attention; the fused kernel's rows do not depend on the call (chunked == whole, bit for bit)."""
    import json
    import os
    import subprocess
    import sys
    import tarfile

    from series_tool import ROOT as root
    from series_tool import series

    try:
        archive = series.MLXLMSeries().sdist()
    except (series.SeriesError, subprocess.CalledProcessError) as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"mlx-lm's sdist is not reachable: {e}")
    with tarfile.open(archive) as tar:  # its tests/, away from any mlx_lm/ source tree
        members = [m for m in tar.getmembers() if m.name.split("/")[1:2] == ["tests"]]
        tar.extractall(tmp_path, members=members)
    tests = next(tmp_path.glob("*/tests"))
    outcomes = {}
    for run in ("stock", "fused"):
        out = tmp_path / f"{run}.json"
        flag = ["--fused-attention"] if run == "fused" else []
        r = subprocess.run([sys.executable, str(root / "scripts" / "mlx_lm_suite.py"), "run", *flag, str(tests), str(out), "test_models.py"],
                           capture_output=True, text=True, timeout=900, env={**os.environ, "MLX_H2O_BLAS": "reference"})
        assert out.exists(), r.stderr[-3000:]
        outcomes[run] = {t: v["outcome"] for t, v in json.loads(out.read_text())["outcomes"].items()}
    passed = {t for t, o in outcomes["stock"].items() if o == "pass"}
    assert len(passed) > 100
    assert {t: outcomes["fused"].get(t) for t in passed if outcomes["fused"].get(t) != "pass"} == {}
