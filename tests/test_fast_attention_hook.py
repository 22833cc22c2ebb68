"""The opt-in fused CPU attention for every mlx-lm model: same logits as mlx-lm's stock attention."""

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
    x = tokens(40, seed=0, batch=1, vocab=101)
    calls = []

    def counting(*args, **kwargs):
        calls.append(kwargs.get("sinks") is not None)
        return mlx_h2o.scaled_dot_product_attention_with_scores(*args, **kwargs)

    monkeypatch.setattr(hook, "scaled_dot_product_attention_with_scores", counting)
    stock = _logits(model, x, fused=False)
    assert not calls
    fused = _logits(model, x, fused=True)
    assert len(calls) == 2 * (x.shape[1] - 20 + 1)  # every layer, every call went through the kernel
    assert all(calls) == (model_type == "gpt_oss")
    np.testing.assert_allclose(fused, stock, atol=2e-4, rtol=1e-4)


def test_hook_is_removable_and_off_by_default():
    assert not hook.fast_cpu_attention_enabled()
    mlx_h2o.use_fast_cpu_attention(True)
    assert hook.fast_cpu_attention_enabled()
    mlx_h2o.use_fast_cpu_attention(False)
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
