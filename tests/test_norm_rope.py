"""`mlx_h2o.rms_norm` / `mlx_h2o.rope` (one CPU kernel each) against float64 NumPy references and
mx.fast's own ops, and the switch that routes nn.RMSNorm / nn.RoPE (and the SwiGLU MLPs,
test_exp_ops.py) through them."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import cache as lm_cache

import mlx_h2o
from mlx_h2o import cpu_layers
from tiny_models import tiny_model

DTYPES = [mx.float32, mx.float16, mx.bfloat16]
TOL = {mx.float32: 2e-6, mx.float16: 1e-3, mx.bfloat16: 8e-3}


def f64(a):
    return np.array(a.astype(mx.float32), dtype=np.float64)


def rope_reference(x, dims, traditional, base, scale, offset):
    x = f64(x)
    L, half = x.shape[-2], dims // 2
    theta = ((offset + np.arange(L)) * scale)[:, None] * base ** (-np.arange(half) / half)[None]
    c, s = np.cos(theta), np.sin(theta)
    out = x.copy()
    i1 = np.arange(0, dims, 2) if traditional else np.arange(half)
    i2 = i1 + 1 if traditional else i1 + half
    out[..., i1] = x[..., i1] * c - x[..., i2] * s
    out[..., i2] = x[..., i1] * s + x[..., i2] * c
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_matches_float64_and_mx_fast(dtype):
    rng = np.random.default_rng(0)
    for shape in [(1, 1, 576), (2, 7, 64), (3, 5), (13,)]:
        x = mx.array((rng.standard_normal(shape) * 3).astype(np.float32)).astype(dtype)
        for w in [mx.array(rng.standard_normal(shape[-1]).astype(np.float32)).astype(dtype), None]:
            got = mlx_h2o.rms_norm(x, w, 1e-5)
            ref = f64(x) / np.sqrt((f64(x) ** 2).mean(-1, keepdims=True) + 1e-5) * (f64(w) if w is not None else 1)
            expect = mx.fast.rms_norm(x, w, 1e-5)
            assert got.dtype == expect.dtype and got.shape == x.shape
            np.testing.assert_allclose(f64(got), ref, rtol=TOL[dtype], atol=TOL[dtype])
    # Strided x (a transposed view) and a weight of another dtype (result type promotes).
    x = mx.array(rng.standard_normal((64, 4)).astype(np.float32)).astype(dtype).T
    w = mx.array(rng.standard_normal(64).astype(np.float32))
    got = mlx_h2o.rms_norm(x, w, 1e-6)
    assert got.dtype == mx.fast.rms_norm(x, w, 1e-6).dtype
    np.testing.assert_allclose(f64(got), f64(mx.fast.rms_norm(x, w, 1e-6)), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_matches_float64(traditional, dtype):
    rng = np.random.default_rng(1)
    for shape, dims, offset, base, scale in [((1, 9, 1, 64), 64, 0, 10000.0, 1.0), ((2, 3, 5, 64), 32, 700, 500000.0, 1.0),
                                             ((1, 4, 3, 80), 80, 8191, 10000.0, 0.25), ((2, 6, 48), 48, 3, 10000.0, 1.0)]:
        x = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
        got = mlx_h2o.rope(x, dims, traditional=traditional, base=base, scale=scale, offset=offset)
        assert got.dtype == dtype and got.shape == x.shape
        ref = rope_reference(x, dims, traditional, base, scale, offset)
        np.testing.assert_allclose(f64(got), ref, rtol=TOL[dtype], atol=TOL[dtype])
        # mx.fast.rope rounds the angles to float32 first: ours is at least as close to float64.
        fast = mx.fast.rope(x, dims, traditional=traditional, base=base, scale=scale, offset=offset)
        assert np.abs(f64(got) - ref).max() <= np.abs(f64(fast) - ref).max() + TOL[dtype]


def test_rope_reads_strided_queries():
    """mlx-lm ropes (B, L, H, D) projections seen as (B, H, L, D)."""
    rng = np.random.default_rng(2)
    x = mx.array(rng.standard_normal((2, 5, 9, 64)).astype(np.float32)).transpose(0, 2, 1, 3)
    got = mlx_h2o.rope(x, 64, traditional=False, base=10000.0, scale=1.0, offset=17)
    np.testing.assert_allclose(f64(got), rope_reference(x, 64, False, 10000.0, 1.0, 17), rtol=2e-6, atol=2e-6)


def test_gradients_through_the_kernels():
    rng = np.random.default_rng(3)
    x = mx.array(rng.standard_normal((2, 3, 4, 32)).astype(np.float32))
    w = mx.array(rng.standard_normal(32).astype(np.float32))
    g = mx.array(rng.standard_normal((2, 3, 4, 32)).astype(np.float32))
    ours = mx.grad(lambda x, w: (mlx_h2o.rms_norm(mlx_h2o.rope(x, 32, traditional=False, base=1e4, scale=1.0, offset=5), w, 1e-5) * g).sum(), argnums=(0, 1))(x, w)
    stock = mx.grad(lambda x, w: (mx.fast.rms_norm(mx.fast.rope(x, 32, traditional=False, base=1e4, scale=1.0, offset=5), w, 1e-5) * g).sum(), argnums=(0, 1))(x, w)
    for a, b in zip(ours, stock):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_heads_rope_is_the_rotated_groups_of_a_packed_projection(traditional, dtype):
    """A packed q/k/v product (B, L, sum(heads) * D) as one (B, heads[i], L, D) array per group, the
    first `rotated` groups rotated: against float64, and bit for bit against `rope` of each group of
    the reshaped product (what the flat block did before)."""
    rng = np.random.default_rng(5)
    for B, L, heads, D, rotated, dims, offset in [(1, 1, [9, 3, 3], 64, 2, 64, 511), (2, 3, [4, 2, 2], 32, 2, 16, 0),
                                                  (1, 5, [2, 2], 48, 1, 48, 70), (3, 1, [1, 1, 1, 2], 16, 3, 8, 9),
                                                  (1, 2, [3], 8, 0, 8, 4)]:
        x = mx.array(rng.standard_normal((B, L, sum(heads) * D)).astype(np.float32)).astype(dtype)
        got = mlx_h2o.split_heads_rope(x, heads, D, rotated=rotated, dims=dims, traditional=traditional, base=5e5,
                                       scale=0.5, offset=offset)
        groups = np.split(f64(x).reshape(B, L, sum(heads), D).transpose(0, 2, 1, 3), np.cumsum(heads)[:-1], axis=1)
        each = mx.split(x.reshape(B, L, sum(heads), D).transpose(0, 2, 1, 3), [int(h) for h in np.cumsum(heads)[:-1]], axis=1)
        assert len(got) == len(heads)
        for i, (g, ref, part) in enumerate(zip(got, groups, each)):
            assert g.shape == (B, heads[i], L, D) and g.dtype == dtype
            if i < rotated:
                ref = rope_reference(mx.array(ref.astype(np.float32)), dims, traditional, 5e5, 0.5, offset)
                part = mlx_h2o.rope(part, dims, traditional=traditional, base=5e5, scale=0.5, offset=offset)
            np.testing.assert_allclose(f64(g), ref, rtol=TOL[dtype], atol=TOL[dtype])
            np.testing.assert_array_equal(np.array(g.astype(mx.float32)), np.array(part.astype(mx.float32)))


def test_split_heads_rope_gives_each_group_in_its_dtype_with_the_bits_of_a_cast():
    """dtypes: each group of float32 x as `.astype(its dtype)` of the float32 group, bit for bit (a
    cache's float16 keys and values straight from the kernel), rotated pairs of two dtypes included."""
    rng = np.random.default_rng(8)
    for B, L, heads, D, rotated, dims, offset, dtypes in [
            (1, 1, [9, 3, 3], 64, 2, 64, 511, [mx.float32, mx.float16, mx.float16]),
            (2, 3, [4, 2, 2], 32, 2, 16, 7, [mx.float32, mx.bfloat16, mx.float16]),
            (1, 4, [2, 1], 16, 2, 16, 0, [mx.float16, mx.float16]),
            (1, 2, [2, 2, 1], 16, 0, 16, 3, [mx.bfloat16, mx.float32, mx.float16])]:
        x = mx.array(rng.standard_normal((B, L, sum(heads) * D)).astype(np.float32))
        args = dict(rotated=rotated, dims=dims, base=1e4, scale=1.0, offset=offset)
        got = mlx_h2o.split_heads_rope(x, heads, D, dtypes=dtypes, **args)
        each = mlx_h2o.split_heads_rope(x, heads, D, **args)
        for g, e, want in zip(got, each, dtypes):
            assert g.dtype == want
            np.testing.assert_array_equal(np.array(g.astype(mx.float32)), np.array(e.astype(want).astype(mx.float32)))
    with pytest.raises(ValueError, match="one dtype per group"):
        mlx_h2o.split_heads_rope(x, heads, D, dtypes=[mx.float16], **args)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        mlx_h2o.split_heads_rope(x, heads, D, dtypes=[mx.int32] * len(heads), **args)
    with pytest.raises(ValueError, match="list of mx dtypes"):
        mlx_h2o.split_heads_rope(x, heads, D, dtypes=["float16", "float16"], **args)
    with pytest.raises(ValueError, match="need float32 x"):
        mlx_h2o.split_heads_rope(x.astype(mx.float16), heads, D, dtypes=[mx.float32] * len(heads), **args)
    # the same dtypes as x's: as without them
    same = mlx_h2o.split_heads_rope(x.astype(mx.bfloat16), heads, D, dtypes=[mx.bfloat16] * len(heads), **args)
    plain = mlx_h2o.split_heads_rope(x.astype(mx.bfloat16), heads, D, **args)
    for a, b in zip(same, plain):
        np.testing.assert_array_equal(np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32)))


def test_split_heads_rope_gradient_and_bad_input():
    rng = np.random.default_rng(6)
    x = mx.array(rng.standard_normal((1, 2, 4 * 16)).astype(np.float32))
    g = [mx.array(rng.standard_normal((1, h, 2, 16)).astype(np.float32)) for h in (2, 1, 1)]

    def loss(split):
        def f(x):
            return sum((a * b).sum() for a, b in zip(split(x), g))
        return f

    ours = mx.grad(loss(lambda x: mlx_h2o.split_heads_rope(x, [2, 1, 1], 16, rotated=2, dims=16, offset=3)))(x)

    def stock(x):
        q, k, v = mx.split(x.reshape(1, 2, 4, 16).transpose(0, 2, 1, 3), [2, 3], axis=1)
        return [mx.fast.rope(q, 16, traditional=False, base=1e4, scale=1.0, offset=3),
                mx.fast.rope(k, 16, traditional=False, base=1e4, scale=1.0, offset=3), v]

    np.testing.assert_allclose(np.array(ours), np.array(mx.grad(loss(stock))(x)), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="not sum\\(heads\\) \\* head_dim"):
        mlx_h2o.split_heads_rope(x, [2, 1, 2], 16, rotated=2, dims=16)
    with pytest.raises(ValueError, match="rotated must be in"):
        mlx_h2o.split_heads_rope(x, [2, 1, 1], 16, rotated=4, dims=16)
    with pytest.raises(ValueError, match="dims must be even"):
        mlx_h2o.split_heads_rope(x, [2, 1, 1], 16, rotated=2, dims=18)
    with pytest.raises(ValueError, match="at least one head"):
        mlx_h2o.split_heads_rope(x, [4, 0], 16, rotated=1, dims=16)
    with pytest.raises(ValueError, match="x must be a float"):
        mlx_h2o.split_heads_rope(x[0], [2, 1, 1], 16, rotated=2, dims=16)
    with pytest.raises(ValueError, match="offset must be an integer"):
        mlx_h2o.split_heads_rope(x, [2, 1, 1], 16, rotated=2, dims=16, offset=mx.array(1))


def test_bad_input():
    x = mx.ones((1, 2, 3, 8))
    with pytest.raises(ValueError, match="dims must be even"):
        mlx_h2o.rope(x, 7, traditional=False, base=1e4, scale=1.0, offset=0)
    with pytest.raises(ValueError, match="dims must be even"):
        mlx_h2o.rope(x, 10, traditional=False, base=1e4, scale=1.0, offset=0)
    with pytest.raises(ValueError, match="offset must be an integer"):
        mlx_h2o.rope(x, 8, traditional=False, base=1e4, scale=1.0, offset=mx.array(2))
    with pytest.raises(ValueError, match="x must be a float"):
        mlx_h2o.rope(x[0, 0, 0], 8, traditional=False, base=1e4, scale=1.0, offset=0)
    with pytest.raises(ValueError, match="weight must be a float array of shape"):
        mlx_h2o.rms_norm(x, mx.ones((7,)), 1e-5)
    with pytest.raises(ValueError, match="x must be a float"):
        mlx_h2o.rms_norm(x.astype(mx.int32), None, 1e-5)


def test_model_layers_use_the_kernels_and_agree_with_stock(monkeypatch):
    """A tiny llama switched to the kernels (use_cpu_layer_kernels(model), no model edits) decodes with
    nn.RMSNorm / nn.RoPE / its MLPs through them, and its logits equal the stock layers' within float32
    rounding; switching back restores MLX's classes, and another model is never touched."""
    model = tiny_model("llama")
    bystander = tiny_model("llama")
    tokens = mx.array([[3, 17, 99, 5, 42, 7]])

    def logits():
        cache = lm_cache.make_prompt_cache(model)
        outs = [model(tokens[:, :4], cache=cache)]
        outs += [model(tokens[:, t : t + 1], cache=cache) for t in (4, 5)]
        return np.array(mx.concatenate(outs, axis=1))

    calls = []
    for name in ("rms_norm", "rope", "swiglu"):
        real = getattr(mlx_h2o._ext, name)
        monkeypatch.setattr(mlx_h2o._ext, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))
    stock = logits()
    assert not calls
    layers = len(model.layers)
    switched = 5 * layers + 1  # 2 norms, rope, MLP, the flat block per layer; final norm
    assert mlx_h2o.use_cpu_layer_kernels(model) == switched
    assert cpu_layers.cpu_layer_kernels_used(bystander) == 0
    ours = logits()
    assert calls.count("rope") == 3 * 2 * layers and calls.count("rms_norm") == 3 * (2 * layers + 1)
    assert calls.count("swiglu") == 3 * layers
    calls.clear()
    assert mlx_h2o.use_cpu_layer_kernels(model, False) == switched
    assert type(model.model.norm) is nn.RMSNorm
    np.testing.assert_array_equal(logits(), stock)
    assert not calls
    np.testing.assert_allclose(ours, stock, rtol=1e-4, atol=1e-4)
