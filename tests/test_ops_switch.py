"""The switch between the extension's attention op and MLX's own (src/mlx_h2o/_ops.py, MLX_H2O_OPS).

Both implementations are checked against the composed definition on the same random calls (dense,
packed, several segments in one or mixed formats, masks, sinks, every score mode) where this MLX
has the ops, i.e. was built from patches/mlx (scripts/build_wheels.sh); the whole suite also runs with
MLX_H2O_OPS=mlx there (docs/mlx-fork.md). Also a packed buffer read up to `rows` and a rotated
cache's query and output rotations, which the extension's op takes and MLX's is given around it."""

import numpy as np
import pytest
from attention_reference import float_queries

import mlx.core as mx
from mlx_h2o import PackedKV, _ops, attention_with_scores

needs_fork = pytest.mark.skipif(
    not _ops.mlx_has_ops(),
    reason="needs an MLX built with patches/mlx (scripts/build_wheels.sh; docs/mlx-fork.md)",
)


@pytest.fixture
def fresh_switch(monkeypatch):
    """The switch as a new process sees it: unset until the first op reads MLX_H2O_OPS."""
    monkeypatch.setattr(_ops, "_current", None)
    yield monkeypatch


def test_default_is_the_extension(fresh_switch):
    fresh_switch.delenv("MLX_H2O_OPS", raising=False)
    assert _ops.implementation() == "ext"


def test_environment_picks_and_bad_values_are_named(fresh_switch):
    fresh_switch.setenv("MLX_H2O_OPS", "auto")
    assert _ops.implementation() == ("mlx" if _ops.mlx_has_ops() else "ext")
    fresh_switch.setattr(_ops, "_current", None)
    fresh_switch.setenv("MLX_H2O_OPS", "fast")
    with pytest.raises(ValueError, match=r"MLX_H2O_OPS must be one of \('ext', 'mlx', 'auto'\), got 'fast'"):
        _ops.implementation()
    with pytest.raises(ValueError, match="must be one of"):
        _ops.set_implementation("metal")


@pytest.mark.skipif(_ops.mlx_has_ops(), reason="this MLX has the ops (built from patches/mlx)")
def test_mlx_without_the_ops_says_how_to_get_them(fresh_switch):
    with pytest.raises(ValueError, match="scripts/build_wheels.sh"):
        _ops.set_implementation("mlx")
    assert _ops.implementation() == "ext"  # a refused switch changes nothing


def _cases():
    """(name, q, segments, kwargs, dense k, dense v, direct) with segments as attention_with_scores takes
    them; direct: one segment whose K and V mx.fast takes as they are (no merge, no dequantization)."""
    rng = np.random.default_rng(0)

    def normal(*shape, dtype=mx.float32):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)

    def packed(x, bits, group_size):
        w, scales, biases = mx.quantize(x, group_size, bits)
        dense = mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32), group_size, bits)
        return PackedKV(w, scales, biases, bits, group_size), dense

    q = normal(2, 6, 3, 64)
    k1, v1 = normal(2, 2, 40, 64), normal(2, 2, 40, 64, dtype=mx.float16)
    k2, v2 = normal(2, 2, 70, 64), normal(2, 2, 70, 64)
    (k1q, k1d), (v1q, v1d) = packed(k1, 4, 64), packed(v1, 4, 64)
    (k2q, k2d), (v2q, v2d) = packed(k2, 8, 32), packed(v2, 4, 64)
    mask = mx.array(rng.random((3, 110)) < 0.8)

    def cat(*parts):  # keys or values along the sequence
        return mx.concatenate(parts, axis=2)

    sinks = normal(6)
    yield "dense", q, [(k1, v1)], {"mask": "causal"}, k1, v1, True
    yield "packed", q, [(k1q, v1q)], {"sinks": sinks}, k1d, v1d, True
    yield "packed keys, dense values", q.astype(mx.float16), [(k1q, v1)], {}, k1d, v1, False
    yield "dense+dense", q, [(k1, v1), (k2, v2)], {"mask": mask}, cat(k1, k2), cat(v1, v2), False
    yield "packed+packed", q, [(k1q, v1q), (k1q, v1q)], {}, cat(k1d, k1d), cat(v1d, v1d), False
    rotation = mx.array(np.linalg.qr(rng.standard_normal((64, 64)))[0].astype(np.float32))

    def with_spare_rows(x):  # a cache's buffer with room for 5 more rows, read up to its 40
        return PackedKV(*(mx.concatenate([a, a[:, :, :5]], axis=2) for a in x.arrays), x.bits, x.group_size, 40)

    yield (
        "packed in place, rotated queries and output",
        q,
        [(with_spare_rows(k1q), with_spare_rows(v1q))],
        {"q_rotation": rotation, "out_rotation": rotation.T},  # (transposed strides: the op copies them)
        k1d,
        v1d,
        False,
    )
    yield (
        "8-bit+4-bit keys, dense window",
        q.astype(mx.bfloat16),
        [(k2q, v2q), (k1q, v1), (k1[:, :, :0], v1[:, :, :0])],
        {"mask": "causal", "sinks": sinks},
        cat(k2d, k1d),
        cat(v2d, v1.astype(mx.float32)),
        False,
    )


TOLERANCE = {mx.float32: 2e-5, mx.float16: 2e-3, mx.bfloat16: 1e-2}


@needs_fork
@pytest.mark.parametrize("scores", ["mass", "logits", None])
def test_both_implementations_agree_with_the_definition(scores):
    # The extension's int8-query option (on by default: packed 4-/8-bit keys dotted with int8-rounded
    # queries) has no counterpart in mx.fast's op, which keeps float32 queries; off here, so both run
    # the kernel's float path that the definition describes.
    previous = _ops.implementation()
    try:
        with float_queries():
            for name, q, segments, kwargs, k, v, direct in _cases():
                ref = attention_with_scores(q, [(k, v)], scale=0.125, scores=scores, composed=True, **kwargs)
                results = {}
                for impl in ("ext", "mlx"):
                    _ops.set_implementation(impl)
                    results[impl] = attention_with_scores(q, segments, scale=0.125, scores=scores, **kwargs)
                if direct:  # MLX runs the very kernel the extension does, on the same arrays
                    for a, b in zip(results["ext"], results["mlx"]):
                        assert (a is None and b is None) or mx.array_equal(a, b).item(), name
                tol = TOLERANCE[q.dtype]
                for impl, (out, sc) in results.items():
                    assert out.dtype == q.dtype, (name, impl)
                    got, want = np.array(out.astype(mx.float32)), np.array(ref[0].astype(mx.float32))
                    np.testing.assert_allclose(got, want, atol=tol, rtol=tol, err_msg=f"{name} {impl}")
                    if scores is None:
                        assert sc is None
                    else:
                        a, b = np.array(sc), np.array(ref[1])
                        assert np.array_equal(np.isneginf(a), np.isneginf(b)), (name, impl)
                        finite = ~np.isneginf(b)
                        np.testing.assert_allclose(a[finite], b[finite], atol=1e-4, rtol=1e-4, err_msg=f"{name} {impl}")
    finally:
        _ops.set_implementation(previous)


@needs_fork
def test_mlx_op_refuses_what_the_extension_refuses():
    previous = _ops.implementation()
    q, k = mx.zeros((1, 4, 2, 64)), mx.zeros((1, 2, 10, 64))
    try:
        for impl in ("ext", "mlx"):
            _ops.set_implementation(impl)
            with pytest.raises(ValueError, match="at most 4"):
                attention_with_scores(q, [(k, k)] * 5, scale=0.1)
            with pytest.raises(ValueError, match="same head dim"):
                attention_with_scores(q[..., :32], [(k, k)], scale=0.1)
    finally:
        _ops.set_implementation(previous)


@needs_fork
def test_both_implementations_fold_a_score_column():
    """score_column under MLX's op: its mass folded by accumulate_prefix after it (mx.fast's ops take
    no column), the same column as the extension's op makes from its own mass."""
    from mlx_h2o._native import _ext

    previous = _ops.implementation()
    rng = np.random.default_rng(4)
    try:
        with float_queries():
            for name, q, segments, kwargs, k, v, direct in _cases():
                acc = mx.array(rng.standard_normal((k.shape[0], k.shape[1], k.shape[2] + 3)).astype(np.float32))
                for impl in ("ext", "mlx"):
                    _ops.set_implementation(impl)
                    out, mass, column = attention_with_scores(q, segments, scale=0.125, score_column=(acc, 0.5, 2.0, 4), **kwargs)
                    assert mx.array_equal(column, _ext.accumulate_prefix(acc, mass, 0.5, 2.0, 4)).item(), (name, impl)
    finally:
        _ops.set_implementation(previous)
