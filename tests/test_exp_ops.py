"""The kernels on the vectorized exp (csrc/kernels/exp_ops_*): `mlx_h2o.swiglu` and the row logsumexp
(`_ext.logsumexp_last_axis`, which the fork's MLX runs for `mx.logsumexp`) against float64 NumPy
references and the stock ops, and the switch of mlx-lm's SwiGLU MLPs to the swiglu kernel."""

import importlib
import inspect

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import mlx_h2o
from mlx_h2o import _ext, cpu_layers
from tiny_models import tiny_model

DTYPES = [mx.float32, mx.float16, mx.bfloat16]
TOL = {mx.float32: 2e-6, mx.float16: 1e-3, mx.bfloat16: 8e-3}


def f64(a):
    return np.array(a.astype(mx.float32), dtype=np.float64)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_swiglu_matches_float64_and_mlx_lm(dtype):
    from mlx_lm.models.activations import swiglu

    rng = np.random.default_rng(4)
    for shape in [(1, 1, 1536), (2, 7, 64), (5,), (3, 13)]:  # lengths past and short of 8-wide vectors
        gate = mx.array((rng.standard_normal(shape) * 6).astype(np.float32)).astype(dtype)
        up = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
        got = mlx_h2o.swiglu(gate, up)
        assert got.dtype == dtype and got.shape == gate.shape
        ref = f64(gate) / (1 + np.exp(-f64(gate))) * f64(up)
        np.testing.assert_allclose(f64(got), ref, rtol=TOL[dtype], atol=TOL[dtype])
        np.testing.assert_allclose(f64(got), f64(swiglu(gate, up)), rtol=2 * TOL[dtype], atol=2 * TOL[dtype])
    # Strided (transposed) inputs, and large |gate| on both sides (exp's range: sigmoid saturates to 0 / 1).
    gate = mx.array(np.linspace(-90, 90, 64, dtype=np.float32).reshape(8, 8)).astype(dtype).T
    up = mx.ones((8, 8), dtype)
    ref = f64(gate) / (1 + np.exp(-f64(gate)))
    np.testing.assert_allclose(f64(mlx_h2o.swiglu(gate, up)), ref, rtol=TOL[dtype], atol=TOL[dtype])


def test_swiglu_gradient_and_bad_input():
    rng = np.random.default_rng(5)
    gate, up, g = (mx.array(rng.standard_normal((3, 40)).astype(np.float32)) for _ in range(3))
    ours = mx.grad(lambda a, b: (mlx_h2o.swiglu(a, b) * g).sum(), argnums=(0, 1))(gate, up)
    stock = mx.grad(lambda a, b: (a * mx.sigmoid(a) * b * g).sum(), argnums=(0, 1))(gate, up)
    for a, b in zip(ours, stock):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="one shape"):
        mlx_h2o.swiglu(gate, up[:, :8])
    with pytest.raises(ValueError, match="of one dtype"):
        mlx_h2o.swiglu(gate, up.astype(mx.float16))
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        mlx_h2o.swiglu(gate.astype(mx.int32), up.astype(mx.int32))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_swiglu_of_the_halves_of_a_packed_product(dtype):
    """`_ext.swiglu_halves(x)`: swiglu of x's last-axis halves (gate, then up), what a packed gate/up
    product gives: float64 reference, the same bits as swiglu on the halves, every row of x."""
    rng = np.random.default_rng(6)
    for shape in [(1, 1, 3072), (2, 7, 128), (10,), (3, 26), (4, 2)]:  # halves past and short of 8-wide vectors
        x = mx.array((rng.standard_normal(shape) * 6).astype(np.float32)).astype(dtype)
        gate, up = mx.split(x, 2, axis=-1)
        got = _ext.swiglu_halves(x)
        assert got.dtype == dtype and got.shape == gate.shape
        ref = f64(gate) / (1 + np.exp(-f64(gate))) * f64(up)
        np.testing.assert_allclose(f64(got), ref, rtol=TOL[dtype], atol=TOL[dtype])
        np.testing.assert_array_equal(f64(got), f64(mlx_h2o.swiglu(gate, up)))
    x = mx.array(rng.standard_normal((6, 8)).astype(np.float32)).astype(dtype).T  # strided: copied once
    np.testing.assert_array_equal(f64(_ext.swiglu_halves(x)), f64(mlx_h2o.swiglu(*mx.split(x, 2, axis=-1))))


def test_swiglu_halves_gradient_and_bad_input():
    rng = np.random.default_rng(7)
    x, g = mx.array(rng.standard_normal((3, 80)).astype(np.float32)), mx.array(rng.standard_normal((3, 40)).astype(np.float32))
    ours = mx.grad(lambda a: (_ext.swiglu_halves(a) * g).sum())(x)
    stock = mx.grad(lambda a: (a[:, :40] * mx.sigmoid(a[:, :40]) * a[:, 40:] * g).sum())(x)
    np.testing.assert_allclose(np.array(ours), np.array(stock), rtol=1e-5, atol=1e-6)
    for bad in [x[:, :79], x[:, :0], x.astype(mx.int32), mx.array(1.0)]:
        with pytest.raises(ValueError, match="gate and up"):
            _ext.swiglu_halves(bad)


@pytest.mark.parametrize("module, name", sorted(cpu_layers.SWIGLU_MLPS))
def test_swiglu_mlps_compute_what_the_kernel_replaces(module, name):
    """The switch replaces these classes' call: it must still be exactly down_proj(swiglu(gate_proj(x), up_proj(x)))."""
    source = inspect.getsource(getattr(importlib.import_module(module), name).__call__)
    body = [line.strip() for line in source.splitlines()[1:] if line.strip()]
    assert body == ["return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))"], source


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "olmo2"])
def test_swiglu_mlps_of_other_architectures_agree_with_stock(arch):
    model = tiny_model(arch)
    tokens = mx.array([[3, 17, 99, 5, 42, 7]])
    stock = np.array(model(tokens))
    assert mlx_h2o.use_cpu_layer_kernels(model) > 0
    assert all(isinstance(layer.mlp, cpu_layers.KernelSwiGLU) for layer in model.layers)
    np.testing.assert_allclose(np.array(model(tokens)), stock, rtol=1e-4, atol=1e-4)
    mlx_h2o.use_cpu_layer_kernels(model, False)
    assert not any(isinstance(layer.mlp, cpu_layers.KernelSwiGLU) for layer in model.layers)
    np.testing.assert_array_equal(np.array(model(tokens)), stock)


def test_swiglu_mlp_with_projections_of_two_dtypes_takes_mlx_lms_activation():
    """Outside the kernel's domain (gate and up of two dtypes) the switched MLP computes what mlx-lm's does."""
    model = tiny_model("llama")
    mlp = model.layers[0].mlp
    mlp.up_proj.update({"weight": mlp.up_proj.weight.astype(mx.float16)})
    x = mx.random.normal((1, 3, mlp.gate_proj.weight.shape[1])).astype(mx.float16)  # gate float32, up float16
    assert mlp.gate_proj(x).dtype != mlp.up_proj(x).dtype
    stock = mlp(x)
    mlx_h2o.use_cpu_layer_kernels(model)
    assert isinstance(mlp, cpu_layers.KernelSwiGLU)
    np.testing.assert_array_equal(np.array(mlp(x)), np.array(stock))


def test_default_kernels_add_swiglu_where_mlx_runs_the_rest():
    """load()'s default: every kernel on stock MLX; on the fork's MLX (which runs norms, RoPE and the
    quantized layers itself) the SwiGLU MLPs and the flat llama blocks only."""
    model = tiny_model("llama")
    fork = cpu_layers.mlx_has_layer_kernels()
    layers = len(model.layers)
    assert mlx_h2o.use_default_cpu_kernels(model) == (2 * layers if fork else 5 * layers + 1)
    assert all(isinstance(layer.mlp, cpu_layers.KernelSwiGLU) for layer in model.layers)
    assert (type(model.model.norm) is nn.RMSNorm) == fork


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_logsumexp_matches_float64_and_mx(dtype):
    rng = np.random.default_rng(6)
    for shape in [(1,), (7,), (8,), (3, 9), (1, 49152), (2, 3, 100)]:
        x = mx.array((rng.standard_normal(shape) * 30).astype(np.float32)).astype(dtype)
        got = _ext.logsumexp_last_axis(x, None)
        assert got.dtype == dtype and got.shape == x.shape[:-1]
        m = f64(x).max(-1, keepdims=True)
        ref = (m + np.log(np.exp(f64(x) - m).sum(-1, keepdims=True)))[..., 0]
        np.testing.assert_allclose(f64(got), ref, rtol=TOL[dtype], atol=TOL[dtype])
        np.testing.assert_allclose(f64(got), f64(mx.logsumexp(x, axis=-1)), rtol=2 * TOL[dtype], atol=2 * TOL[dtype])
    # A strided view, and rows with +inf, all -inf, a NaN, and -inf beside a finite value.
    x = mx.array(rng.standard_normal((20, 3)).astype(np.float32)).T
    np.testing.assert_allclose(np.array(_ext.logsumexp_last_axis(x, None)), np.array(mx.logsumexp(x, axis=-1)), rtol=1e-6)
    inf, nan = float("inf"), float("nan")
    special = mx.array([[1.0, inf, 2.0], [-inf, -inf, -inf], [1.0, nan, 2.0], [-inf, 0.0, -inf]]).astype(dtype)
    got = f64(_ext.logsumexp_last_axis(special, None))
    assert got[0] == inf and got[1] == -inf and np.isnan(got[2]) and got[3] == 0.0


def test_logsumexp_gradient_and_bad_input():
    rng = np.random.default_rng(7)
    x, g = (mx.array(rng.standard_normal((3, 40)).astype(np.float32)) for _ in range(2))
    ours = mx.grad(lambda a: (_ext.logsumexp_last_axis(a, None) * g[:, 0]).sum())(x)
    stock = mx.grad(lambda a: (mx.logsumexp(a, axis=-1) * g[:, 0]).sum())(x)
    np.testing.assert_allclose(np.array(ours), np.array(stock), rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="non-empty last axis"):
        _ext.logsumexp_last_axis(mx.zeros((3, 0)), None)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        _ext.logsumexp_last_axis(mx.zeros((3,), mx.int32), None)
