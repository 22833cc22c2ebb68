"""Build and runtime plumbing: the extension, its MLX version pin, the BLAS shim, the CLI."""

import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

import mlx_h2o
from mlx_h2o import _ext
from mlx_h2o._version_check import check_extension


def test_extension_built_against_running_mlx():
    assert _ext.built_with_mlx.split(".")[:2] == mx.__version__.split(".")[:2]
    assert _ext.linked_mlx_version() == mx.__version__


def test_version_mismatch_is_refused():
    major, minor = mx.__version__.split(".")[:2]
    with pytest.raises(ImportError, match="rebuild"):
        check_extension(f"{major}.{int(minor) + 1}.0")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the shim is Linux-only")
def test_blas_shim_active_and_exact():
    assert mlx_h2o.blas_backend().startswith("OpenBLAS"), mlx_h2o.blas_backend()
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((67, 129)), rng.standard_normal((129, 33))
    for dtype, tol in ((mx.float32, 1e-4), (mx.float16, 2e-2)):
        got = np.array((mx.array(a).astype(dtype) @ mx.array(b).astype(dtype)).astype(mx.float32))
        np.testing.assert_allclose(got, a @ b, atol=tol * 10, rtol=tol)
    got = np.array(mx.array(a.T).T @ mx.array(b))  # transposed operand
    np.testing.assert_allclose(got, a @ b, atol=1e-3, rtol=1e-4)


def test_blas_backend_reports_late_import():
    code = "import mlx.core, mlx_h2o; print(mlx_h2o.use_openblas())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "imported before use_openblas" in out or not sys.platform.startswith("linux")


def test_opting_in_to_openblas_puts_its_idle_threads_to_sleep():
    """use_openblas() sets OPENBLAS_THREAD_TIMEOUT for the OpenBLAS it loads (where not set: a user's
    own value stays), and nothing when MLX came first (no OpenBLAS of ours loads then)."""
    code = "import os, mlx_h2o; mlx_h2o.use_openblas(); print(os.environ.get('OPENBLAS_THREAD_TIMEOUT'))"
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_THREAD_TIMEOUT", "MLX_H2O_BLAS")}
    run = lambda code, **extra: subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                               env={**env, **extra}).stdout.strip()
    if sys.platform.startswith("linux"):
        assert run(code) == "4"
        assert run(code, OPENBLAS_THREAD_TIMEOUT="8") == "8"
    assert run("import mlx.core\n" + code) == "None"


# Importing mlx_h2o and every module of it, first or after MLX, must leave MLX and mlx-lm as they
# were: the same layer methods, mlx-lm's attention function, no BLAS shim in the process, and the C
# allocator's own mmap threshold.
_IMPORT_CHANGES_NOTHING = """
import importlib, pkgutil, sys
{first}
import mlx.core as mx, mlx.nn as nn
from mlx_lm.models import base
methods = [(c, m) for c in (nn.Linear, nn.QuantizedLinear, nn.QuantizedEmbedding, nn.Embedding, nn.RMSNorm,
                            nn.LayerNorm, nn.RoPE) for m in ("__call__", "as_linear") if hasattr(c, m)]
before = {{k: getattr(*k) for k in methods}}
sdpa = (base.scaled_dot_product_attention, base.scaled_dot_product_attention.__code__)
import mlx_h2o
for name in sorted(mlx_h2o.__all__):
    getattr(mlx_h2o, name)
for mod in pkgutil.walk_packages(mlx_h2o.__path__, "mlx_h2o."):
    if mod.name != "mlx_h2o.__main__" and not mod.name.split(".")[-1].startswith("lib"):  # lib*: the shim, no module
        importlib.import_module(mod.name)
changed = [f"{{c.__name__}}.{{m}}" for (c, m), f in before.items() if getattr(c, m) is not f]
assert not changed, f"rebound at import: {{changed}}"
assert (base.scaled_dot_product_attention, base.scaled_dot_product_attention.__code__) == sdpa
assert "libmlx_h2o_blas" not in open("/proc/self/maps").read(), "BLAS shim loaded at import"
assert mlx_h2o._allocator.mmap_threshold() is None, "the C allocator's mmap threshold set at import"
print("unchanged", mlx_h2o.blas_backend())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
@pytest.mark.parametrize("first", ["", "import mlx_h2o"])
def test_import_changes_nothing_in_mlx(first):
    env = {k: v for k, v in os.environ.items() if k != "MLX_H2O_BLAS"}
    r = subprocess.run([sys.executable, "-c", _IMPORT_CHANGES_NOTHING.format(first=first)], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and "unchanged MLX's own BLAS" in r.stdout, r.stderr[-3000:]


def test_uninitialized_op():
    a = _ext.uninitialized([3, 5], mx.float16)
    assert a.shape == (3, 5) and a.dtype == mx.float16
    # Contents are arbitrary (maybe NaN) until written; a full overwrite makes them defined.
    a[:] = mx.full((3, 5), 2.0, mx.float16)
    assert a.sum().item() == 30
    with pytest.raises(ValueError, match="non-negative"):
        _ext.uninitialized([-1, 2], mx.float32)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "mlx_h2o", *args], capture_output=True, text=True)


def test_cli_help_lists_subcommands():
    r = _cli("--help")
    assert r.returncode == 0
    assert "generate" in r.stdout and "eval" in r.stdout


def test_cli_errors_are_clear(tmp_path):
    r = _cli("generate", "--prompt", "hi", "--max-kv-size", "0")
    assert r.returncode == 2 and "must be >= 1" in r.stderr
    r = _cli("generate", "--prompt", "hi", "--kv-policy", "lru")
    assert r.returncode == 2 and "invalid choice" in r.stderr
    r = _cli("generate", "--prompt-file", str(tmp_path / "missing.txt"))
    assert r.returncode == 2 and "cannot read --prompt-file" in r.stderr
    r = _cli("eval", "--text-files", str(tmp_path / "missing.txt"), "--kv-policy", "full")
    assert r.returncode == 2 and "not found" in r.stderr


def test_cli_generate_streams_and_reports(smollm):
    r = _cli("generate", "--prompt", "Name a colour.", "--max-tokens", "12", "--kv-policy", "rotating", "--max-kv-size", "32")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    assert "tokens-per-sec" in r.stderr and "KV cache (rotating): 32 tokens per layer" in r.stderr
    assert "(float16 rows)" in r.stderr


def test_cli_eval_json(smollm, tmp_path):
    out = tmp_path / "r.json"
    r = _cli("eval", "--kv-policy", "full", "rotating", "--max-kv-size", "16", "--seq-len", "48", "--samples", "2",
             "--json", str(out), "--quiet")
    assert r.returncode == 0, r.stderr
    assert "| rotating(M=16) | 48 |" in r.stdout
    import json

    rows = json.loads(out.read_text())["perplexity"]
    assert len(rows) == 2 and rows[0]["policy"] == "full"


def test_generated_option_tables_are_current():
    """README.md and docs/policies.md show the policies' option tables as the code declares them."""
    from pathlib import Path

    root = Path(__file__).parent.parent
    r = _cli("options", "--check", str(root / "README.md"), str(root / "docs" / "policies.md"))
    assert r.returncode == 0, r.stderr
