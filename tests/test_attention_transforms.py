"""Gradients, forward-mode derivatives and vmap through the fused attention primitive.

The primitive differentiates through its composed definition; these tests check the result against an
independent float64 NumPy derivation of softmax attention's gradients (dense and packed K/V, masks,
GQA, sinks, the output and the "mass" scores as outputs), forward mode against the vjp by the
transpose identity, vmap against a loop, and mx.grad of a tiny mlx-lm model with the hook on against
mlx-lm's stock attention.
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from attention_reference import _f64, make_inputs, random_mask, randn
from test_quantized_attention import quantize

import mlx_h2o
from mlx_h2o import PackedKV, attention_with_scores
from mlx_h2o.attention import attention_with_scores_composed
from mlx.utils import tree_flatten
from tiny_models import tiny_model

sdpa = mlx_h2o.scaled_dot_product_attention_with_scores


def reference_grads(q, k, v, scale, mask, sinks, d_out, d_mass):
    """float64 (dq, dk, dv) of <d_out, out> + <d_mass, mass> for attention (out, mass)."""
    q, k, v, d_out, d_mass = (_f64(a) for a in (q, k, v, d_out, d_mass))
    B, Hq, L, _ = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G = Hq // Hkv
    qg = q.reshape(B, Hkv, G, L, -1)
    s = np.einsum("bhgld,bhnd->bhgln", qg, k) * scale
    if isinstance(mask, str):
        s = np.where(np.arange(N - L, N)[:, None] >= np.arange(N)[None], s, -np.inf)
    elif mask is not None:
        m = np.broadcast_to(np.array(mask) if mask.dtype == mx.bool_ else _f64(mask), (B, Hq, L, N)).reshape(B, Hkv, G, L, N)
        s = np.where(m, s, -np.inf) if mask.dtype == mx.bool_ else s + m
    top = s.max(-1, keepdims=True)
    if sinks is not None:
        sk = _f64(sinks).reshape(1, Hkv, G, 1, 1)
        top = np.maximum(top, sk)
    e = np.exp(s - top)
    den = e.sum(-1, keepdims=True) + (np.exp(sk - top) if sinks is not None else 0.0)
    p = e / den
    do = d_out.reshape(B, Hkv, G, L, -1)
    dp = np.einsum("bhgld,bhnd->bhgln", do, v) + d_mass[:, :, None, None, :]
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) * scale
    dq = np.einsum("bhgln,bhnd->bhgld", ds, k).reshape(q.shape)
    dk = np.einsum("bhgln,bhgld->bhnd", ds, qg)
    dv = np.einsum("bhgln,bhgld->bhnd", p, do)
    return dq, dk, dv


CASES = [  # (B, Hq, Hkv, L, N, D, dtype, mask kind, sinks)
    (1, 4, 4, 1, 37, 16, mx.float32, None, False),
    (2, 6, 2, 5, 70, 24, mx.float32, "causal", False),
    (1, 8, 2, 3, 130, 64, mx.float32, "bool", True),
    (2, 4, 1, 4, 65, 40, mx.float32, "additive", False),
    (1, 4, 2, 7, 7, 32, mx.float16, "causal", True),
    (1, 3, 3, 2, 90, 72, mx.bfloat16, "additive", True),
]


def _tol(dtype):
    return {mx.float32: 2e-4, mx.float16: 2e-2, mx.bfloat16: 8e-2}[dtype]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-H{c[1]}/{c[2]}-L{c[3]}-N{c[4]}-D{c[5]}-{c[7]}-sinks{c[8]}")
def test_vjp_matches_float64_reference(case):
    B, Hq, Hkv, L, N, D, dtype, kind, has_sinks = case
    rng = np.random.default_rng(N)
    q, k, v = make_inputs(rng, B, Hq, Hkv, L, N, D, dtype)
    mask = random_mask(rng, kind, B, Hq, L, N)
    sinks = mx.array(rng.standard_normal(Hq).astype(np.float32)) if has_sinks else None
    d_out = randn(rng, (B, Hq, L, D), mx.float32)
    d_mass = randn(rng, (B, Hkv, N), mx.float32)
    scale = D**-0.5

    def loss(q, k, v):
        out, mass = sdpa(q, k, v, scale=scale, mask=mask, sinks=sinks, scores="mass")
        return (out.astype(mx.float32) * d_out).sum() + (mass * d_mass).sum()

    grads = mx.grad(loss, argnums=(0, 1, 2))(q, k, v)
    ref = reference_grads(q, k, v, scale, mask, sinks, d_out, d_mass)
    tol = _tol(dtype)
    for name, g, r in zip("qkv", grads, ref):
        assert g.dtype == dtype and g.shape == r.shape, name
        np.testing.assert_allclose(_f64(g), r, atol=tol * max(1.0, np.abs(r).max()), rtol=tol, err_msg=f"d{name}")


def test_vjp_of_logits_scores_and_value_only_output():
    """Cotangents on the "logits" output, and on the output alone (scores=None)."""
    rng = np.random.default_rng(1)
    q, k, v = make_inputs(rng, 1, 4, 2, 3, 50, 32, mx.float32)
    w = randn(rng, (1, 4, 3, 50), mx.float32)

    def loss(fn, scores):
        def f(q, k, v):
            out, sc = fn(q, k, v, scale=0.2, mask="causal", scores=scores)
            x = (out * out).sum()
            if scores == "logits":
                x = x + mx.where(mx.isinf(sc), 0.0, sc * w).sum()
            return x

        return f

    for scores in ("logits", None):
        fused = mx.grad(loss(sdpa, scores), argnums=(0, 1, 2))(q, k, v)
        composed = mx.grad(loss(attention_with_scores_composed, scores), argnums=(0, 1, 2))(q, k, v)
        for a, b in zip(fused, composed):
            np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-5, rtol=1e-5)


def test_vjp_through_packed_and_mixed_segments():
    """Gradient w.r.t. q over packed K/V, and w.r.t. q and a dense segment's k / v when it sits next
    to packed segments: equal to the float64 reference on the dequantized, concatenated keys."""
    rng = np.random.default_rng(2)
    B, Hq, Hkv, L, D = 1, 6, 2, 4, 64
    q = randn(rng, (B, Hq, L, D), mx.float32)
    _, k0, v0 = make_inputs(rng, B, Hq, Hkv, L, 120, D, mx.float32)
    _, k1, v1 = make_inputs(rng, B, Hq, Hkv, L, 40, D, mx.float32)
    (k0q, k0d), (v0q, v0d) = quantize(k0, 4, 32), quantize(v0, 8, 64)
    packed = (PackedKV(*k0q, 4, 32), PackedKV(*v0q, 8, 64))
    d_out = randn(rng, (B, Hq, L, D), mx.float32)
    d_mass = randn(rng, (B, Hkv, 160), mx.float32)

    def loss(q, k1, v1):
        out, mass = attention_with_scores(q, [packed, (k1, v1)], scale=0.125, mask="causal")
        return (out * d_out).sum() + (mass * d_mass).sum()

    dq, dk1, dv1 = mx.grad(loss, argnums=(0, 1, 2))(q, k1, v1)
    k_all, v_all = mx.concatenate([k0d, k1], axis=2), mx.concatenate([v0d, v1], axis=2)
    rq, rk, rv = reference_grads(q, k_all, v_all, 0.125, "causal", None, d_out, d_mass)
    np.testing.assert_allclose(np.array(dq), rq, atol=2e-4, rtol=2e-4)
    np.testing.assert_allclose(np.array(dk1), rk[:, :, 120:], atol=2e-4, rtol=2e-4)
    np.testing.assert_allclose(np.array(dv1), rv[:, :, 120:], atol=2e-4, rtol=2e-4)

    # Only q: packed K and V alone, through the public quantized op.
    v0q4, v0d4 = quantize(v0, 4, 32)

    def loss_q(q):
        out, _ = mlx_h2o.quantized_scaled_dot_product_attention_with_scores(
            q, k0q, v0q4, scale=0.125, bits=4, group_size=32, scores=None
        )
        return (out * d_out).sum()

    rq, _, _ = reference_grads(q, k0d, v0d4, 0.125, None, None, d_out, mx.zeros((B, Hkv, 120)))
    np.testing.assert_allclose(np.array(mx.grad(loss_q)(q)), rq, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("kind,sinks", [("causal", False), ("additive", True), ("bool", False)])
def test_jvp_is_the_transpose_of_the_vjp(kind, sinks):
    """<d_out, J t> == <J^T d_out, t> for tangents on q, k and v at once; and jvp equals the composed
    definition's."""
    rng = np.random.default_rng(3)
    B, Hq, Hkv, L, N, D = 2, 4, 2, 3, 45, 32
    q, k, v = make_inputs(rng, B, Hq, Hkv, L, N, D, mx.float32)
    mask = random_mask(rng, kind, B, Hq, L, N)
    sk = mx.array(rng.standard_normal(Hq).astype(np.float32)) if sinks else None
    tq, tk, tv = make_inputs(rng, B, Hq, Hkv, L, N, D, mx.float32)
    d_out = randn(rng, (B, Hq, L, D), mx.float32)

    def f(fn):
        return lambda q, k, v: fn(q, k, v, scale=0.3, mask=mask, sinks=sk, scores=None)[0]

    _, (jt,) = mx.jvp(f(sdpa), [q, k, v], [tq, tk, tv])
    _, (jt_ref,) = mx.jvp(f(attention_with_scores_composed), [q, k, v], [tq, tk, tv])
    np.testing.assert_allclose(np.array(jt), np.array(jt_ref), atol=1e-5, rtol=1e-5)
    _, vjps = mx.vjp(f(sdpa), [q, k, v], [d_out])
    lhs = float((_f64(d_out) * _f64(jt)).sum())
    rhs = sum(float((_f64(g) * _f64(t)).sum()) for g, t in zip(vjps, (tq, tk, tv)))
    assert abs(lhs - rhs) <= 1e-4 * max(1.0, abs(lhs))


def test_vmap_over_a_batch_axis_equals_the_loop():
    rng = np.random.default_rng(4)
    Hq, Hkv, L, N, D = 4, 2, 3, 33, 16
    qs = randn(rng, (5, 1, Hq, L, D), mx.float32)
    ks = randn(rng, (5, 1, Hkv, N, D), mx.float32)
    v = randn(rng, (1, Hkv, N, D), mx.float32)  # shared: not mapped

    def f(q, k):
        out, mass = sdpa(q, k, v, scale=0.25, mask="causal")
        return out, mass

    outs, masses = mx.vmap(f, in_axes=(0, 0))(qs, ks)
    for i in range(5):
        o, m = f(qs[i], ks[i])
        np.testing.assert_allclose(np.array(outs[i]), np.array(o), atol=1e-6, rtol=1e-5)
        np.testing.assert_allclose(np.array(masses[i]), np.array(m), atol=1e-6, rtol=1e-5)
    # Mapped along another axis of q (its query heads' batch of 1 stays), output axis 0.
    outs2, _ = mx.vmap(f, in_axes=(2, None))(qs.transpose(1, 2, 0, 3, 4), ks[0])
    for i in range(5):
        np.testing.assert_allclose(np.array(outs2[i]), np.array(f(qs[i], ks[0])[0]), atol=1e-6, rtol=1e-5)


def test_grad_of_an_mlx_lm_model_with_the_hook_on():
    """mx.grad of a tiny llama's loss (LoRA-style fine-tuning's first step) with the fused attention on
    equals the one with mlx-lm's stock attention."""
    model = tiny_model("llama")
    tokens = mx.array(np.random.default_rng(5).integers(0, 128, (2, 24)))

    def loss(model):
        logits = model(tokens[:, :-1])
        return nn.losses.cross_entropy(logits, tokens[:, 1:]).mean()

    grad_fn = nn.value_and_grad(model, loss)
    try:
        mlx_h2o.use_fast_cpu_attention(True)
        fused_loss, fused = grad_fn(model)
        mx.eval(fused_loss, fused)
    finally:
        mlx_h2o.use_fast_cpu_attention(None)
    stock_loss, stock = grad_fn(model)
    np.testing.assert_allclose(fused_loss.item(), stock_loss.item(), rtol=1e-5)
    for (name, a), (_, b) in zip(tree_flatten(fused), tree_flatten(stock)):
        np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-5, rtol=1e-3, err_msg=name)
