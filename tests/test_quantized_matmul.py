"""`mlx_h2o.quantized_matmul` (int8 activations x packed 4/8-bit weights) against a float64 reference,
and the switch that routes nn.QuantizedLinear / QuantizedEmbedding.as_linear through it.

The kernel rounds each 32-value block c of x to int8 with scale d_c = max|x_c| / 127 and computes the
exact product of that rounded x with W, so each output differs from x @ W^T by at most
sum_j (d_c(j) / 2) * |W_nj| plus float32 rounding. The tests compute that bound per output and require
the error to stay inside it, and the mean error to be far below it (rounding errors are unbiased).
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from test_quantized_attention import numpy_dequantize

import mlx_h2o
from mlx_h2o import _ext, quantized_matmul
from mlx_h2o import cpu_layers
from tiny_models import tiny_model

DTYPES = [mx.float32, mx.float16, mx.bfloat16]
OUT_ULP = {mx.float32: 2e-7, mx.float16: 1e-3, mx.bfloat16: 8e-3}  # relative rounding of the output dtype


def reference_and_bound(x, w, scales, biases, group_size, bits):
    """float64 x @ W^T from the stored values, and the int8-activation error bound per output."""
    xf = np.array(x.astype(mx.float32), dtype=np.float64).reshape(-1, x.shape[-1])
    W = numpy_dequantize(w, scales, biases, bits, group_size)
    ref = xf @ W.T
    K = xf.shape[1]
    d = np.abs(xf).reshape(-1, K // 32, 32).max(-1) / 127  # (M, K/32)
    half_step = np.repeat(d / 2, 32, axis=-1)  # (M, K)
    bound = half_step @ np.abs(W).T
    out_shape = (*x.shape[:-1], w.shape[0])
    return ref.reshape(out_shape), bound.reshape(out_shape), (np.abs(xf) @ np.abs(W).T).reshape(out_shape)


def check(x, wq, group_size, bits, **kw):
    y = quantized_matmul(x, *wq, group_size=group_size, bits=bits, **kw)
    expect_dtype = mx.quantized_matmul(x[..., :1, :], *wq, transpose=True, group_size=group_size, bits=bits).dtype
    assert y.dtype == expect_dtype and y.shape == (*x.shape[:-1], wq[0].shape[0])
    ref, bound, mag = reference_and_bound(x, *wq, group_size, bits)
    err = np.abs(np.array(y.astype(mx.float32), dtype=np.float64) - ref)
    slack = 1e-5 * mag + OUT_ULP[y.dtype] * np.abs(ref)  # float32 accumulation + output rounding
    assert np.all(err <= bound + slack), f"max excess {np.max(err - bound - slack):.3g}"
    return err, bound


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_within_the_int8_bound(bits, group_size, dtype):
    rng = np.random.default_rng(bits * 1000 + group_size)
    errs, bounds = [], []
    for M, N, K in [(1, 1, 128), (1, 200, 384), (2, 77, 512), (3, 33, 256), (5, 64, 640), (8, 300, 128)]:
        w = mx.array(rng.standard_normal((N, K)).astype(np.float32) * 0.05).astype(dtype)
        wq = mx.quantize(w, group_size=group_size, bits=bits)
        x = mx.array((rng.standard_normal((M, K)) * rng.uniform(0.1, 10)).astype(np.float32)).astype(dtype)
        err, bound = check(x, wq, group_size, bits)
        errs.append(err.ravel())
        bounds.append(bound.ravel())
    # Unbiased rounding: the typical error is a small fraction of the worst case.
    assert np.mean(np.concatenate(errs)) < 0.25 * np.mean(np.concatenate(bounds))


@pytest.mark.parametrize("group_size, K", [(32, 96), (32, 352), (32, 576), (64, 320), (64, 576), (128, 384)])
def test_4bit_blocks_in_eights_pairs_and_a_lone_block(group_size, K):
    """The AVX2 path takes 4-bit blocks 8 at a time, then in pairs, then a trailing one alone: block counts
    3 (a pair and one), 11 (eight, a pair, one), 18 (two eights, a pair), 10 and 12 with wider groups."""
    rng = np.random.default_rng(K + group_size)
    for M, N in [(1, 40), (3, 17), (5, 64)]:
        w = mx.array(rng.standard_normal((N, K)).astype(np.float32) * 0.05)
        x = mx.array((rng.standard_normal((M, K)) * rng.uniform(0.1, 10)).astype(np.float32))
        for sdtype in (mx.float32, mx.float16):
            check(x, mx.quantize(w.astype(sdtype), group_size=group_size, bits=4), group_size, 4)


@pytest.mark.parametrize("bits, group_size", [(4, 32), (4, 64), (8, 32), (8, 128)])
def test_a_row_alone_and_among_rows_gives_the_same_bits(bits, group_size):
    """One row of x (decode) runs the kernel's one-row code, several rows its four-, three- and two-row
    code. Column counts of every remainder modulo 4 and 8, with and without a fused residual: the same
    bits either way, so a token's logits do not depend on how many rows its call had."""
    rng = np.random.default_rng(bits + group_size)
    K = 576 if 576 % group_size == 0 else 640  # 18 blocks (two eights and a pair) or 20
    for N in (4, 5, 38, 131):
        wq = mx.quantize(mx.array(rng.standard_normal((N, K)).astype(np.float32) * 0.05), group_size=group_size, bits=bits)
        x = mx.array(rng.standard_normal((1, 6, K)).astype(np.float32))
        residual = mx.array(rng.standard_normal((1, 6, N)).astype(np.float32))
        for kw in ({}, {"residual": residual}):
            together = quantized_matmul(x, *wq, group_size=group_size, bits=bits, **kw)
            alone = [quantized_matmul(x[:, i : i + 1], *wq, group_size=group_size, bits=bits,
                                      **{k: v[:, i : i + 1] for k, v in kw.items()}) for i in range(6)]
            np.testing.assert_array_equal(np.array(together), np.array(mx.concatenate(alone, axis=1)))
        check(x[:, :1], wq, group_size, bits)


def test_leading_axes_strided_x_and_scale_dtypes():
    rng = np.random.default_rng(1)
    w = mx.array(rng.standard_normal((96, 256)).astype(np.float32))
    for sdtype in DTYPES:
        wq = mx.quantize(w.astype(sdtype), group_size=64, bits=4)
        x = mx.array(rng.standard_normal((2, 3, 256)).astype(np.float32))  # 6 rows in (B, L, K)
        check(x, wq, 64, 4)
        xt = mx.array(rng.standard_normal((256, 2)).astype(np.float32)).T  # not row-contiguous
        check(xt, wq, 64, 4)


def test_long_inputs_take_dequantize_and_gemm():
    """More than max_rows rows: the composed path, equal to dequantize-then-matmul (no int8 error)."""
    rng = np.random.default_rng(2)
    w = mx.array(rng.standard_normal((64, 128)).astype(np.float32))
    wq = mx.quantize(w, group_size=32, bits=8)
    x = mx.array(rng.standard_normal((1, 40, 128)).astype(np.float32))
    ref = np.array(x) @ numpy_dequantize(*wq, 8, 32).T
    np.testing.assert_allclose(np.array(quantized_matmul(x, *wq, group_size=32, bits=8)), ref, rtol=1e-4, atol=1e-4)
    # max_rows moves the switch: 40 rows through the kernel, within its bound.
    check(x, wq, 32, 8, max_rows=64)
    np.testing.assert_allclose(
        np.array(quantized_matmul(x[:, :2], *wq, group_size=32, bits=8, max_rows=0)), ref[:, :2], rtol=1e-4, atol=1e-4
    )


@pytest.mark.parametrize("bits", [4, 8])
def test_long_float32_inputs_take_the_blocked_gemm(bits):
    """More than max_rows float32 rows: one primitive that dequantizes W a block of rows at a time
    into the GEMM (960 rows of 576 columns: three blocks, the last a partial one), with the norm, the
    swiglu, the residual or the activation of its output (swiglu_output) as the ops alone give them.
    Against float64 from the stored values, and bit for bit against the ops one by one."""
    from mlx_h2o.evaluation.speed import graph_primitives

    rng = np.random.default_rng(20 + bits)
    N, K = 960, 576
    for M, group_size, sdtype in [(40, 32, mx.float32), (100, 64, mx.float16), (33, 64, mx.bfloat16)]:
        wq = mx.quantize(mx.array(rng.standard_normal((N, K)).astype(np.float32) * 0.05).astype(sdtype),
                         group_size=group_size, bits=bits)
        W = numpy_dequantize(*wq, bits, group_size)
        x = mx.array(rng.standard_normal((1, M, K)).astype(np.float32) * 3)
        gate_up = mx.array(rng.standard_normal((1, M, 2 * K)).astype(np.float32) * 3)
        weight = mx.array(rng.uniform(0.5, 2, K).astype(np.float32))
        residual = mx.array(rng.standard_normal((1, M, N)).astype(np.float32))
        qmm = lambda x, **kw: quantized_matmul(x, *wq, group_size=group_size, bits=bits, **kw)
        x64, g64, u64 = np.array(x, np.float64), *np.split(np.array(gate_up, np.float64), 2, axis=-1)
        n64 = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-5) * np.array(weight, np.float64)
        a64 = g64 / (1 + np.exp(-g64)) * u64
        p64 = x64 @ W.T
        cases = [  # (kwargs, x, the ops one by one, float64)
            ({}, x, x @ _ext.dequantize_affine(*wq, group_size, bits, mx.float32).T, p64),  # W dense at once
            (dict(norm_weight=weight, norm_eps=1e-5), x, qmm(mlx_h2o.rms_norm(x, weight, 1e-5)), n64 @ W.T),
            (dict(swiglu=True), gate_up, qmm(_ext.swiglu_halves(gate_up)), a64 @ W.T),
            (dict(residual=residual), x, residual + qmm(x), np.array(residual, np.float64) + p64),
            (dict(swiglu_output=True), x, _ext.swiglu_halves(qmm(x)),
             p64[..., : N // 2] / (1 + np.exp(-p64[..., : N // 2])) * p64[..., N // 2 :]),
        ]
        for kw, xin, ops, ref in cases:
            got = qmm(xin, **kw)
            assert sum(graph_primitives(got).values()) == 1, kw  # one primitive, however many blocks
            assert got.dtype == mx.float32 and got.shape == ref.shape
            mag = np.abs(ref).max()
            np.testing.assert_allclose(np.array(got, np.float64), ref, rtol=0, atol=2e-6 * mag)
            np.testing.assert_array_equal(np.array(got), np.array(ops), err_msg=str(kw))
    # Other dtypes take the composed ops: swiglu_output is the activation of the product there too,
    # on the kernel's rows as on the dequantize + GEMM path.
    wq = mx.quantize(mx.array(rng.standard_normal((64, 128)).astype(np.float32)), group_size=32, bits=bits)
    for M, dtype in [(40, mx.float16), (3, mx.float32), (3, mx.bfloat16)]:
        x = mx.array(rng.standard_normal((M, 128)).astype(np.float32)).astype(dtype)
        got = quantized_matmul(x, *wq, group_size=32, bits=bits, swiglu_output=True)
        expect = _ext.swiglu_halves(quantized_matmul(x, *wq, group_size=32, bits=bits))
        assert got.dtype == expect.dtype and got.shape == (M, 32)
        np.testing.assert_array_equal(np.array(got.astype(mx.float32)), np.array(expect.astype(mx.float32)))


def test_portable_variant_and_one_thread_agree():
    import os
    import subprocess
    import sys

    code = (
        "import sys; sys.path[:0] = {path!r}\n"
        "import mlx_h2o, numpy as np, mlx.core as mx, test_quantized_matmul as t\n"
        "rng = np.random.default_rng(3)\n"
        "for bits, gs, M in [(4, 32, 1), (8, 64, 3), (4, 128, 8)]:\n"
        "    w = mx.array(rng.standard_normal((130, 256)).astype(np.float32))\n"
        "    x = mx.array(rng.standard_normal((M, 256)).astype(np.float32)).astype(mx.bfloat16)\n"
        "    t.check(x, mx.quantize(w, group_size=gs, bits=bits), gs, bits)\n"
        "print(mlx_h2o._ext.kernel_isa())\n"
    ).format(path=[os.path.dirname(__file__)] + [p for p in sys.path if p])
    for env, isa in [({"MLX_H2O_KERNEL_ISA": "portable"}, "portable"), ({"MLX_H2O_NUM_THREADS": "1"}, _ext.kernel_isa())]:
        r = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True)
        assert r.returncode == 0 and r.stdout.strip() == isa, r.stderr[-3000:]


def test_gradient_wrt_x_through_the_kernel():
    """vjp through the composed definition: d/dx <g, x @ W^T> = g @ W (the dequantized W)."""
    rng = np.random.default_rng(4)
    w = mx.array(rng.standard_normal((40, 64)).astype(np.float32))
    wq = mx.quantize(w, group_size=32, bits=4)
    x = mx.array(rng.standard_normal((1, 64)).astype(np.float32))
    g = mx.array(rng.standard_normal((1, 40)).astype(np.float32))
    dx = mx.grad(lambda x: (quantized_matmul(x, *wq, group_size=32, bits=4) * g).sum())(x)
    np.testing.assert_allclose(np.array(dx), np.array(g) @ numpy_dequantize(*wq, 4, 32), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bits", [4, 8])
def test_norm_and_residual_inside_the_product_give_the_bits_of_the_ops(bits):
    """A block's norm before its product, an MLP's swiglu before its down projection and the residual
    add after either, in the product's primitive: bit for bit `residual + quantized_matmul(
    rms_norm(x, weight, eps))` and `residual + quantized_matmul(swiglu_halves(gate_up))` (each op
    alone) for every mix of dtypes, on the kernel's rows and on the dequantize + GEMM path; and within
    the int8 bound of the float64 product of the float64-normed / -activated x."""
    rng = np.random.default_rng(bits)
    for (M, N, K, group_size), (xd, wd, sd, rd) in zip(
            [(1, 96, 128, 32), (3, 40, 256, 64), (1, 200, 384, 128), (5, 64, 640, 32), (2, 33, 128, 64), (40, 24, 128, 32),
             (32, 64, 576, 32)],  # 32 rows of 576: a norm that rounds one value differently shows (it did once)
            [(mx.float32,) * 4, (mx.float16, mx.float16, mx.float16, mx.float16), (mx.bfloat16, mx.float32, mx.bfloat16, mx.float32),
             (mx.float32, mx.float16, mx.float32, mx.bfloat16), (mx.bfloat16,) * 4, (mx.float32,) * 4, (mx.float32,) * 4]):
        wq = mx.quantize(mx.array(rng.standard_normal((N, K)).astype(np.float32) * 0.05).astype(sd), group_size=group_size, bits=bits)
        x = mx.array((rng.standard_normal((1, M, K)) * rng.uniform(0.1, 10)).astype(np.float32)).astype(xd)
        weight = mx.array(rng.uniform(0.5, 2, K).astype(np.float32)).astype(wd)
        normed = mlx_h2o.rms_norm(x, weight, 1e-5)
        residual = mx.array(rng.standard_normal((1, M, N)).astype(np.float32)).astype(rd)
        product = quantized_matmul(normed, *wq, group_size=group_size, bits=bits)
        for norm, res, expect in [(True, False, product), (False, True, residual + quantized_matmul(x, *wq, group_size=group_size, bits=bits)),
                                  (True, True, residual + product)]:
            got = quantized_matmul(x, *wq, group_size=group_size, bits=bits, norm_weight=weight if norm else None,
                                   norm_eps=1e-5 if norm else None, residual=residual if res else None)
            assert got.dtype == expect.dtype and got.shape == expect.shape
            np.testing.assert_array_equal(np.array(got.astype(mx.float32)), np.array(expect.astype(mx.float32)))
        gate_up = mx.array(rng.standard_normal((1, M, 2 * K)).astype(np.float32) * 3).astype(xd)  # a packed gate/up product
        activated = quantized_matmul(_ext.swiglu_halves(gate_up), *wq, group_size=group_size, bits=bits)
        for res, expect in [(False, activated), (True, residual + activated)]:
            got = quantized_matmul(gate_up, *wq, group_size=group_size, bits=bits, swiglu=True, residual=residual if res else None)
            assert got.dtype == expect.dtype and got.shape == expect.shape
            np.testing.assert_array_equal(np.array(got.astype(mx.float32)), np.array(expect.astype(mx.float32)))
        if xd == wd == sd == rd == mx.float32 and M <= 32:
            x64 = np.array(x, dtype=np.float64)
            n64 = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-5) * np.array(weight, dtype=np.float64)
            ref, bound, mag = reference_and_bound(mx.array(n64.astype(np.float32)), *wq, group_size, bits)
            got = np.array(quantized_matmul(x, *wq, group_size=group_size, bits=bits, norm_weight=weight, norm_eps=1e-5,
                                            residual=residual), dtype=np.float64)
            assert np.all(np.abs(got - np.array(residual, dtype=np.float64) - ref) <= bound + 1e-5 * mag + 1e-6)
            g64, u64 = np.split(np.array(gate_up, dtype=np.float64), 2, axis=-1)
            ref, bound, mag = reference_and_bound(mx.array((g64 / (1 + np.exp(-g64)) * u64).astype(np.float32)), *wq, group_size, bits)
            got = np.array(quantized_matmul(gate_up, *wq, group_size=group_size, bits=bits, swiglu=True), dtype=np.float64)
            assert np.all(np.abs(got - ref) <= bound + 1e-5 * mag + 1e-6)
    # No weight: the norm alone.
    wq = mx.quantize(mx.array(rng.standard_normal((8, 128)).astype(np.float32)), group_size=32, bits=bits)
    x = mx.array(rng.standard_normal((1, 2, 128)).astype(np.float32))
    np.testing.assert_array_equal(np.array(quantized_matmul(x, *wq, group_size=32, bits=bits, norm_eps=1e-6)),
                                  np.array(quantized_matmul(mlx_h2o.rms_norm(x, None, 1e-6), *wq, group_size=32, bits=bits)))


def test_gradients_through_the_fused_norm_and_residual():
    """vjp of the fused products (their composed definitions) against the same ops from mx.fast and MLX."""
    rng = np.random.default_rng(7)
    wq = mx.quantize(mx.array(rng.standard_normal((40, 64)).astype(np.float32)), group_size=32, bits=4)
    x, r = (mx.array(rng.standard_normal(s).astype(np.float32)) for s in ((1, 64), (1, 40)))
    w = mx.array(rng.uniform(0.5, 2, 64).astype(np.float32))
    g = mx.array(rng.standard_normal((1, 40)).astype(np.float32))
    dense = mx.dequantize(*wq, group_size=32, bits=4)
    ours = mx.grad(lambda x, w, r: (quantized_matmul(x, *wq, group_size=32, bits=4, norm_weight=w, norm_eps=1e-5, residual=r) * g).sum(),
                   argnums=(0, 1, 2))(x, w, r)
    stock = mx.grad(lambda x, w, r: ((r + mx.fast.rms_norm(x, w, 1e-5) @ dense.T) * g).sum(), argnums=(0, 1, 2))(x, w, r)
    for a, b in zip(ours, stock):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-4)
    gate_up = mx.array(rng.standard_normal((1, 128)).astype(np.float32))
    ours = mx.grad(lambda x: (quantized_matmul(x, *wq, group_size=32, bits=4, swiglu=True) * g).sum())(gate_up)
    stock = mx.grad(lambda x: ((nn.silu(x[:, :64]) * x[:, 64:]) @ dense.T * g).sum())(gate_up)
    np.testing.assert_allclose(np.array(ours), np.array(stock), rtol=1e-4, atol=1e-4)
    # The activation of the product (swiglu_output) through the blocked GEMM's primitive (the kernel's
    # rows are two ops, each with its own vjp).
    x = mx.array(rng.standard_normal((40, 64)).astype(np.float32))
    g = mx.array(rng.standard_normal((40, 20)).astype(np.float32))
    ours = mx.grad(lambda x: (quantized_matmul(x, *wq, group_size=32, bits=4, swiglu_output=True) * g).sum())(x)
    stock = mx.grad(lambda x: (nn.silu(x @ dense[:20].T) * (x @ dense[20:].T) * g).sum())(x)
    np.testing.assert_allclose(np.array(ours), np.array(stock), rtol=1e-4, atol=1e-4)


def test_bad_input():
    rng = np.random.default_rng(5)
    w = mx.array(rng.standard_normal((8, 64)).astype(np.float32))
    wq = mx.quantize(w, group_size=32, bits=4)
    x = mx.ones((1, 64))
    with pytest.raises(ValueError, match="bits must be one of 4, 8"):
        quantized_matmul(x, *mx.quantize(w, group_size=32, bits=3), group_size=32, bits=3)
    with pytest.raises(ValueError, match="group_size must be one of"):
        quantized_matmul(x, *wq, group_size=16, bits=4)
    with pytest.raises(ValueError, match="do not hold K"):
        quantized_matmul(mx.ones((1, 32)), *wq, group_size=32, bits=4)
    with pytest.raises(ValueError, match="do not match w"):
        quantized_matmul(x, *wq, group_size=64, bits=4)
    with pytest.raises(ValueError, match="x's dtype"):
        quantized_matmul(x.astype(mx.int32), *wq, group_size=32, bits=4)
    with pytest.raises(ValueError, match="2-D uint32"):
        quantized_matmul(x, wq[0].astype(mx.int32), *wq[1:], group_size=32, bits=4)
    with pytest.raises(ValueError, match="bits must be an integer"):
        quantized_matmul(x, *wq, group_size=32, bits=4.0)
    with pytest.raises(ValueError, match="norm_weight must be a float array of shape"):
        quantized_matmul(x, *wq, group_size=32, bits=4, norm_weight=mx.ones((7,)), norm_eps=1e-5)
    with pytest.raises(ValueError, match="norm_weight needs norm_eps"):
        quantized_matmul(x, *wq, group_size=32, bits=4, norm_weight=mx.ones((x.shape[-1],)))
    with pytest.raises(ValueError, match="residual must be a float array of the product's shape"):
        quantized_matmul(x, *wq, group_size=32, bits=4, residual=mx.ones((3,)))
    with pytest.raises(ValueError, match="either the swiglu or the norm"):
        quantized_matmul(mx.concatenate([x, x], -1), *wq, group_size=32, bits=4, swiglu=True, norm_eps=1e-5)
    with pytest.raises(ValueError, match="w's words per row do not hold"):
        quantized_matmul(x, *wq, group_size=32, bits=4, swiglu=True)  # x holds K values, not gate and up
    odd = mx.quantize(mx.array(rng.standard_normal((7, 64)).astype(np.float32)), group_size=32, bits=4)
    for rows in (1, 40):  # the kernel's rows and the GEMM's
        with pytest.raises(ValueError, match="swiglu_output takes the halves .* got W of 7 rows"):
            quantized_matmul(mx.ones((rows, 64)), *odd, group_size=32, bits=4, swiglu_output=True)
        with pytest.raises(ValueError, match="no residual, got W of 8 rows and a residual"):
            quantized_matmul(mx.ones((rows, 64)), *wq, group_size=32, bits=4, swiglu_output=True, residual=mx.ones((rows, 8)))


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_embedding_lookup_is_the_stored_rows(bits):
    """quantized_embedding: the rows at int32 / uint32 indices of any shape (negative int32 from the
    end), equal to the float64 decoding of the stored values up to the scales' dtype's rounding (and,
    for float32 scales, to MLX's own lookup); an index outside the rows gives NaN."""
    rng = np.random.default_rng(bits + 10)
    for group_size, sdtype in [(32, mx.float32), (64, mx.float16), (128, mx.bfloat16)]:
        wq = mx.quantize(mx.array(rng.standard_normal((50, 256)).astype(np.float32)).astype(sdtype), group_size=group_size, bits=bits)
        table = numpy_dequantize(*wq, bits, group_size)
        for idx in [mx.array([[3]]), mx.array([7, 0, 49, -1, -50], mx.int32), mx.array([[1, 2], [3, 49]], mx.uint32),
                    mx.array(rng.integers(0, 50, (2, 3, 40)).astype(np.int32))]:
            got = _ext.quantized_embedding(idx, *wq, group_size, bits)
            assert got.dtype == sdtype and got.shape == (*idx.shape, 256)
            np.testing.assert_allclose(np.array(got.astype(mx.float32)), table[np.array(idx)], rtol=OUT_ULP[sdtype] * 2, atol=1e-6)
            if sdtype == mx.float32:  # MLX's own dequantize rounds each step to the scales' dtype
                mlx = mx.dequantize(wq[0][idx], wq[1][idx], wq[2][idx], group_size=group_size, bits=bits)
                np.testing.assert_allclose(np.array(got), np.array(mlx), rtol=1e-6, atol=1e-6)
        out = np.array(_ext.quantized_embedding(mx.array([0, 50, -51, 2**31 - 1]), *wq, group_size, bits).astype(mx.float32))
        assert np.isfinite(out[0]).all() and np.isnan(out[1:]).all()
        assert np.isfinite(np.array(_ext.quantized_embedding(mx.array([4000000000], mx.uint32), *wq, group_size, bits).astype(mx.float32))).sum() == 0
    with pytest.raises(ValueError, match="indices must be int32 or uint32"):
        _ext.quantized_embedding(mx.array([1.0]), *wq, group_size, bits)
    with pytest.raises(ValueError, match="bits must be one of"):
        _ext.quantized_embedding(mx.array([1]), *wq, group_size, 7)
    with pytest.raises(ValueError, match="do not match w"):
        _ext.quantized_embedding(mx.array([1]), *wq, 32 if group_size != 32 else 64, bits)


@pytest.mark.parametrize("mlx_layers", [False, True], ids=["kernel-layers", "mlx-layers"])
def test_quantized_embedding_looks_up_with_the_kernel(mlx_layers):
    """The lookup's kernel with our layers and with MLX's (MLX has no op for it); back to MLX's class."""
    model = tiny_model("llama", tie_word_embeddings=True)
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    tokens = mx.array([[3, 17, 99]])
    stock = model.model.embed_tokens(tokens)
    mlx_h2o.use_cpu_layer_kernels(model, mlx_layers=mlx_layers)
    embed = model.model.embed_tokens
    assert type(embed) is (cpu_layers.QuantizedEmbeddingLookup if mlx_layers else cpu_layers.KernelQuantizedEmbedding)
    graph = embed(tokens)
    from mlx_h2o.evaluation.speed import graph_primitives

    assert graph_primitives(graph) == {"DequantizeAffine": 1}
    np.testing.assert_allclose(np.array(graph), np.array(stock), rtol=1e-6, atol=1e-7)
    mlx_h2o.use_cpu_layer_kernels(model, False)
    assert type(model.model.embed_tokens) is nn.QuantizedEmbedding


def test_quantized_linear_and_tied_embedding_use_the_kernel(monkeypatch):
    """A quantized tiny llama (tied embeddings) switched to the kernel decodes through it with no model
    edits; its logits match MLX's own quantized path within the int8 rounding; switching back
    restores MLX's classes."""
    model = tiny_model("llama", tie_word_embeddings=True)
    nn.quantize(model, group_size=32, bits=4)
    calls = []
    real = _ext.quantized_matmul
    monkeypatch.setattr(_ext, "quantized_matmul", lambda *a, **k: calls.append(a[6]) or real(*a, **k))
    x = mx.array([[3, 17, 99]])
    stock = model(x[:, :1])
    assert not calls
    mlx_h2o.use_cpu_layer_kernels(model)
    ours = model(x[:, :1])
    n_linear = sum(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules())
    packed = [p for b in model.model.layers for p in (b._packed_qkv, b.mlp._packed_gate_up)]  # one product each
    assert len(calls) == n_linear - sum(len(p.parts) - 1 for p in packed) + 1  # + the tied lm_head (QuantizedEmbedding.as_linear)
    mlx_h2o.use_cpu_layer_kernels(model, False)
    calls.clear()
    np.testing.assert_array_equal(np.array(model(x[:, :1])), np.array(stock))
    assert not calls
    np.testing.assert_allclose(np.array(ours), np.array(stock), atol=0.05 * np.abs(np.array(stock)).max())


def test_lora_style_gradient_with_the_kernel_on():
    """mx.grad through a quantized model's QuantizedLinear layers (QLoRA's setting) works with the
    kernel on: the 1-row inputs go through the primitive's composed vjp."""
    model = tiny_model("llama")
    nn.quantize(model, group_size=32, bits=4)
    model.freeze()
    model.model.norm.unfreeze()
    tokens = mx.array([[5, 9]])

    def loss(m):
        return m(tokens[:, :1])[0, -1, tokens[0, 1]]

    stock = nn.value_and_grad(model, loss)(model)[1]
    mlx_h2o.use_cpu_layer_kernels(model)
    ours = nn.value_and_grad(model, loss)(model)[1]
    for (_, a), (_, b) in zip(tree_flatten(ours), tree_flatten(stock)):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=0.1, atol=0.05 * np.abs(np.array(b)).max())


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_dequantize_affine_is_the_stored_values(bits):
    """The prefill path's dequantize: every bits / group / scale dtype / output dtype, equal to the
    float64 decoding of the stored values up to the output dtype's rounding."""
    rng = np.random.default_rng(bits)
    for group_size in (32, 64, 128):
        for sdtype in DTYPES:
            wq = mx.quantize(mx.array(rng.standard_normal((37, 256)).astype(np.float32)).astype(sdtype), group_size=group_size, bits=bits)
            ref = numpy_dequantize(*wq, bits, group_size)
            for odtype in DTYPES:
                got = _ext.dequantize_affine(*wq, group_size, bits, odtype)
                assert got.dtype == odtype and got.shape == ref.shape
                np.testing.assert_allclose(np.array(got.astype(mx.float32)), ref, rtol=OUT_ULP[odtype] * 2, atol=1e-6)


@pytest.mark.slow
def test_int8_activations_cost_at_most_half_a_percent_of_perplexity(smollm, monkeypatch):
    """The real model (packed 4-bit linears, 8-bit tied lm_head): teacher-forced perplexity with every
    row through the int8 kernel vs the dequantized path (dequantize + GEMM, exact), over 512 tokens of
    each of six licence texts. One 512-token text is not enough: a float32 rounding change anywhere
    upstream flips some int8 roundings, and a single text's cost moves by about +-0.5 % with it
    (measured -0.45 % to +0.59 % across these texts); the 3072 tokens together: +0.23 %."""
    from mlx_h2o.evaluation import teacher_forced_nll

    model, tokenizer = mlx_h2o.load(weights="quantized", cpu_kernels=True)  # the extension's kernel, also on the fork
    texts = []
    for name in ("Apache-2.0", "GPL-3", "MPL-2.0", "Artistic", "LGPL-2.1", "GFDL-1.3"):
        with open(f"/usr/share/common-licenses/{name}", encoding="utf-8") as f:
            texts.append(tokenizer.encode(f.read())[:512])
    calls = []
    real = _ext.quantized_matmul
    monkeypatch.setattr(_ext, "quantized_matmul", lambda *a, **k: calls.append(a[6]) or real(*a, **k))
    ppl = {}
    for max_rows in (1 << 20, 0):  # every row through the kernel; none
        monkeypatch.setattr(cpu_layers, "KERNEL_MAX_ROWS", max_rows)
        nll = np.concatenate([np.asarray(teacher_forced_nll(model, t)) for t in texts])
        ppl[max_rows] = float(np.exp(nll.mean()))
    assert sorted(set(calls)) == [0, 1 << 20]
    assert abs(ppl[1 << 20] / ppl[0] - 1) <= 0.005, ppl
