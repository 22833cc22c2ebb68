"""The per-entry columns of a row store (storage/columns.py) and the op that folds attention scores
into them (`accumulate_prefix`, csrc/accumulate_prefix.cpp), against float64 / NumPy references.

Column writes wait until something reads the column; whatever order appends, folds, reads,
compactions, trims, copies and save/load come in, the columns must read as if every write had
happened at once."""

import copy

import mlx.core as mx
import numpy as np
import pytest

from mlx_h2o._native import _ext
from mlx_h2o.storage import ColumnedKV, KVStore


def accumulate_reference(acc, x, alpha, beta, held):
    out = acc.astype(np.float64).copy()
    h = min(held, x.shape[-1])
    out[..., :h] = alpha * out[..., :h] + beta * x[..., :h]
    out[..., h : x.shape[-1]] = beta * x[..., h:]
    return out


def test_accumulate_prefix_matches_float64_on_random_shapes():
    rng = np.random.default_rng(0)
    for trial in range(300):
        lead = tuple(int(d) for d in rng.integers(1, 4, size=int(rng.integers(0, 3))))
        C = int(rng.integers(0, 70))
        N, held = int(rng.integers(0, C + 1)), int(rng.integers(0, C + 1))
        acc = rng.standard_normal(lead + (C,)).astype(np.float32)
        x = rng.standard_normal(lead + (N,)).astype(np.float32)
        alpha, beta = float(rng.standard_normal()), float(rng.standard_normal())
        a = mx.array(acc)
        if trial % 3 == 0 and lead:  # a transposed view: the op reads any strides
            a = mx.array(np.ascontiguousarray(np.moveaxis(acc, -1, 0))).moveaxis(0, -1)
        out = _ext.accumulate_prefix(a, mx.array(x), alpha, beta, held)
        np.testing.assert_allclose(np.array(out), accumulate_reference(acc, x, alpha, beta, held), rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(np.array(a), acc)  # still referenced: never written in place


def test_accumulate_prefix_writes_in_place_only_an_unreferenced_column():
    acc = mx.zeros((1, 3, 1000))
    mx.eval(acc)
    kept = acc
    out = _ext.accumulate_prefix(acc, mx.ones((1, 3, 10)), 1.0, 2.0, 10)
    del acc
    mx.eval(out)
    assert float(kept.sum()) == 0.0 and float(out.sum()) == 60.0


def test_accumulate_prefix_along_passes_an_array_through_beside_the_column():
    rng = np.random.default_rng(1)
    for trial in range(100):
        C = int(rng.integers(1, 70))
        N, held = int(rng.integers(0, C + 1)), int(rng.integers(0, C + 1))
        acc = rng.standard_normal((1, 3, C)).astype(np.float32)
        x = rng.standard_normal((1, 3, N)).astype(np.float32)
        alpha, beta = float(rng.standard_normal()), float(rng.standard_normal())
        along = mx.array(rng.standard_normal((1, 9, 1, 64)).astype(np.float16)) * 2  # unevaluated: a layer's output
        a = mx.array(acc)
        column, passed = _ext.accumulate_prefix_along(a, mx.array(x), alpha, beta, held, along)
        assert passed.shape == along.shape and passed.dtype == along.dtype and column.dtype == mx.float32
        mx.eval(passed)  # the column is its sibling, evaluated with it (tests/h2o/test_cache.py: decoding in constant memory)
        np.testing.assert_array_equal(np.array(passed), np.array(along))
        np.testing.assert_allclose(np.array(column), accumulate_reference(acc, x, alpha, beta, held), rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(np.array(a), acc)
    with pytest.raises(ValueError, match="held must be in"):
        _ext.accumulate_prefix_along(mx.zeros((2, 5)), mx.zeros((2, 3)), 1.0, 1.0, 6, mx.zeros(3))
    d_acc = mx.grad(lambda a: (_ext.accumulate_prefix_along(a, mx.ones((2, 3)), 0.5, 3.0, 2, mx.ones(4))[0] * mx.arange(5)).sum())(
        mx.ones((2, 5)))
    np.testing.assert_allclose(np.array(d_acc), np.tile([0.0, 0.5, 0.0, 3.0, 4.0], (2, 1)))


def test_accumulate_prefix_derivatives_follow_its_definition():
    acc, x = mx.ones((2, 5)), mx.ones((2, 3))
    d_acc, d_x = mx.grad(lambda a, x: (_ext.accumulate_prefix(a, x, 0.5, 3.0, 2) * mx.arange(5)).sum(), argnums=(0, 1))(acc, x)
    np.testing.assert_allclose(np.array(d_acc), np.tile([0.0, 0.5, 0.0, 3.0, 4.0], (2, 1)))
    np.testing.assert_allclose(np.array(d_x), np.tile([0.0, 3.0, 6.0], (2, 1)))


@pytest.mark.parametrize(
    "acc, x, held, match",
    [((2, 5), (2, 6), 0, "more than acc's 5"), ((2, 5), (3, 5), 0, "leading shape"), ((2, 5), (5,), 0, "dimensions"),
     ((2, 5), (2, 3), 6, "held must be in"), ((2, 5), (2, 3), -1, "held must be in")],
)
def test_accumulate_prefix_rejects_bad_input(acc, x, held, match):
    with pytest.raises(ValueError, match=match):
        _ext.accumulate_prefix(mx.zeros(acc), mx.zeros(x), 1.0, 1.0, held)
    with pytest.raises(ValueError, match="float32"):
        _ext.accumulate_prefix(mx.zeros((2, 5), mx.float16), mx.zeros((2, 3)), 1.0, 1.0, 0)


B, H, D = 1, 2, 8


class EagerColumns:
    """What a ColumnedKV's columns must read: every write applied at once, in NumPy."""

    def __init__(self):
        self.acc, self.pos = np.zeros((B, H, 0)), np.zeros((B, H, 0), np.int64)

    def append(self, L, acc, pos):
        acc = np.broadcast_to(np.asarray(acc, np.float64), (B, H, L))
        self.acc = np.concatenate([self.acc, acc], -1)
        self.pos = np.concatenate([self.pos, np.broadcast_to(np.asarray(list(pos)), (B, H, L))], -1)


def test_columns_read_as_if_every_write_happened_at_once():
    rng = np.random.default_rng(3)
    for trial in range(30):
        store, ref, offset = ColumnedKV(KVStore(None), {"acc": "float32", "pos": "int32"}), EagerColumns(), 0
        for step in range(40):
            op = rng.choice(["append", "append", "decode", "decode", "fold", "read", "gather", "trim", "copy", "save"])
            n = store.length
            if op in ("append", "decode") or n == 0:
                L = 1 if op == "decode" else int(rng.integers(1, 6))
                acc = 0.0 if rng.random() < 0.7 else (float(rng.integers(1, 3)) if rng.random() < 0.5 else rng.standard_normal(L).astype(np.float32))
                pos = range(offset, offset + L)
                kv = mx.zeros((B, H, L, D))
                store.append(kv, kv, None, acc=mx.array(acc) if isinstance(acc, np.ndarray) else acc,
                             pos=pos if rng.random() < 0.8 else mx.array(np.arange(offset, offset + L)))
                ref.append(L, acc, pos)
                offset += L
            elif op == "fold":
                x = rng.standard_normal((B, H, n)).astype(np.float32)
                alpha, beta = float(rng.random()), float(rng.random() * 3)
                store.accumulate("acc", mx.array(x), alpha, beta)
                ref.acc = alpha * ref.acc + beta * x
            elif op == "read":
                np.testing.assert_allclose(np.array(store.column("acc")), ref.acc, rtol=1e-5, atol=1e-5)
                np.testing.assert_array_equal(np.array(store.column("pos")), ref.pos)
            elif op == "gather":
                keep = int(rng.integers(1, n + 1))
                idx = np.sort(rng.permutation(n)[:keep])
                store.gather(mx.array(np.broadcast_to(idx, (B, H, keep)).astype(np.int32)), keep, capacity=keep + int(rng.integers(0, 4)))
                ref.acc, ref.pos = ref.acc[..., idx], ref.pos[..., idx]
            elif op == "trim":
                k = int(rng.integers(0, n + 1))
                store.trim(k)
                ref.acc, ref.pos = ref.acc[..., : n - k], ref.pos[..., : n - k]
            elif op == "copy":
                store = copy.deepcopy(store)
            else:
                restored = ColumnedKV(KVStore(None), {"acc": "float32", "pos": "int32"})
                restored.load(store.state())
                store = restored
            assert store.length == ref.acc.shape[-1]
        np.testing.assert_allclose(np.array(store.column("acc")), ref.acc, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(np.array(store.column("pos")), ref.pos)


def test_a_column_value_must_cover_the_appended_entries():
    store = ColumnedKV(KVStore(None), {"acc": "float32", "pos": "int32"})
    kv = mx.zeros((B, H, 3, D))
    with pytest.raises(ValueError, match="2 values for 3 entries"):
        store.append(kv, kv, None, acc=0.0, pos=range(2))


def test_attention_folds_its_mass_into_a_score_column():
    """attention_with_scores(..., score_column=(acc, alpha, beta, held)): the output and mass as without
    it (bit for bit), and the column as accumulate_prefix makes it from that mass (and as float64
    from the reference mass), for dense and packed segments, masks, sinks and rotations; the
    composed path folds its own mass the same way."""
    from attention_reference import reference

    from mlx_h2o import PackedKV, attention_with_scores

    rng = np.random.default_rng(5)
    for trial in range(60):
        B, Hkv, G, L, D = int(rng.integers(1, 3)), int(rng.integers(1, 4)), int(rng.integers(1, 4)), int(rng.integers(1, 4)), 64
        n1, n2 = int(rng.integers(1, 40)), int(rng.integers(0, 30))
        N = n1 + n2
        q = mx.array(rng.standard_normal((B, Hkv * G, L, D)).astype(np.float32))
        k, v = (mx.array(rng.standard_normal((B, Hkv, N, D)).astype(np.float16)) for _ in range(2))
        if trial % 3 == 0 and n2:  # a packed segment after a dense one
            segments = [(k[:, :, :n1], v[:, :, :n1]),
                        (PackedKV(*mx.quantize(k[:, :, n1:], group_size=64, bits=8), 8, 64), PackedKV(*mx.quantize(v[:, :, n1:], group_size=64, bits=8), 8, 64))]
        else:
            segments = [(k, v)]
        mask = ["causal", None, mx.array(rng.random((B, 1, L, N)) < 0.8)][trial % 3] if L <= N else None
        sinks = mx.array(rng.standard_normal(Hkv * G).astype(np.float32)) if trial % 4 == 1 else None
        rotation = None
        if trial % 5 == 2:
            rotation = mx.array(np.linalg.qr(rng.standard_normal((D, D)))[0].astype(np.float32))
        C, held = N + int(rng.integers(0, 20)), int(rng.integers(0, N + 1))
        acc = rng.standard_normal((B, Hkv, C)).astype(np.float32)
        alpha, beta = float(rng.standard_normal()), float(rng.standard_normal())
        kwargs = dict(scale=D**-0.5, mask=mask, scores="mass", sinks=sinks, q_rotation=rotation, out_rotation=rotation)
        out, mass = attention_with_scores(q, segments, **kwargs)
        out2, mass2, column = attention_with_scores(q, segments, **kwargs, score_column=(mx.array(acc), alpha, beta, held))
        assert mx.array_equal(out, out2) and mx.array_equal(mass, mass2)
        assert column.shape == (B, Hkv, C) and column.dtype == mx.float32
        np.testing.assert_array_equal(np.array(column), np.array(_ext.accumulate_prefix(mx.array(acc), mass, alpha, beta, held)))
        if len(segments) == 1 and rotation is None:  # against the float64 reference's mass
            _, ref_mass, _ = reference(q, k, v, D**-0.5, mask, sinks)
            np.testing.assert_allclose(np.array(column), accumulate_reference(acc, ref_mass, alpha, beta, held),
                                       rtol=1e-4, atol=2e-5 * max(1, L) * (1 + abs(beta)))
        out3, mass3, column3 = attention_with_scores(q, segments, **kwargs, composed=True, score_column=(mx.array(acc), alpha, beta, held))
        # (its mass is the definition's: float32 queries where the kernel rounds them to int8 for packed keys)
        np.testing.assert_array_equal(np.array(column3), np.array(_ext.accumulate_prefix(mx.array(acc), mass3, alpha, beta, held)))


def test_attention_score_column_rejects_bad_input():
    from mlx_h2o import attention_with_scores

    q, k = mx.zeros((1, 4, 1, 64)), mx.zeros((1, 2, 10, 64))
    with pytest.raises(ValueError, match="takes scores 'mass'"):
        attention_with_scores(q, [(k, k)], scale=1.0, scores="logits", score_column=(mx.zeros((1, 2, 10)), 1.0, 1.0, 0))
    with pytest.raises(ValueError, match="float32 \\(B, Hkv, C >= N\\)"):
        attention_with_scores(q, [(k, k)], scale=1.0, score_column=(mx.zeros((1, 2, 9)), 1.0, 1.0, 0))
    with pytest.raises(ValueError, match="float32 \\(B, Hkv, C >= N\\)"):
        attention_with_scores(q, [(k, k)], scale=1.0, score_column=(mx.zeros((1, 3, 10)), 1.0, 1.0, 0))
    with pytest.raises(ValueError, match="held must be in"):
        attention_with_scores(q, [(k, k)], scale=1.0, score_column=(mx.zeros((1, 2, 12)), 1.0, 1.0, 13))
    with pytest.raises(ValueError, match="score_column must be"):
        attention_with_scores(q, [(k, k)], scale=1.0, score_column=(mx.zeros((1, 2, 12)), 1.0))
