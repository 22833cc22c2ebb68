"""The ops on a cache's K/V rows (csrc/kv_rows.cpp): `rotate_rows` (rows times a rotation, float64
sums, one rounding) and `quantize_rows_into` (a packed store's new rows rotated, quantized as MLX's
affine format does and written in place); against float64 / NumPy references of the rotation and
of MLX's quantization on random shapes, dtypes, offsets and buffers, against mx.quantize itself, and
the RowStore / rotated store that use them."""

import mlx.core as mx
import numpy as np
import pytest

import mlx_h2o
from mlx_h2o._native import _ext
from mlx_h2o.evaluation.speed import graph_primitives
from mlx_h2o.storage import KVStore, RotatedKV
from mlx_h2o.storage.rotation import KVRotation

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotate_rows_matches_float64_on_random_shapes(dtype):
    rng = np.random.default_rng(11)
    for trial in range(20):
        lead = tuple(int(d) for d in rng.integers(1, 4, size=int(rng.integers(0, 4))))
        D = int(rng.choice([1, 8, 64, 72, 128]))
        x = mx.array(rng.standard_normal(lead + (D,)).astype(np.float32)).astype(DTYPES[dtype])
        if trial % 3 == 0 and len(lead) >= 2:  # a transposed view: copied first, read as rows
            x = mx.array(np.ascontiguousarray(np.swapaxes(as_np(x), 0, 1))).astype(x.dtype).swapaxes(0, 1)
        r = rng.standard_normal((D, D)).astype(np.float32)
        for out_dtype in DTYPES.values():
            got = _ext.rotate_rows(x, mx.array(r), out_dtype)
            want = as_np(x).astype(np.float64) @ r.astype(np.float64)
            assert got.dtype == out_dtype and got.shape == x.shape
            # one rounding: float64 -> float32 -> the output dtype, as the op does
            np.testing.assert_array_equal(as_np(got), as_np(mx.array(want.astype(np.float32)).astype(out_dtype)))


def signed_hadamards(rng, D):
    """The rotations of a rotated cache (RotatedKV: R and R^T of a signed Walsh-Hadamard basis,
    which the op multiplies by a fast transform where 1/sqrt(D) is a power of two), one scaled by
    another power of two, and matrices that only look like them (the dense loop: one entry's sign
    flipped, two rows swapped, a scale that is no power of two)."""
    rotation = KVRotation.seeded(D, D, int(rng.integers(1 << 16)))
    rk_t, rv = np.array(rotation.rk_t), np.array(rotation.rv)
    flipped, swapped = rk_t.copy(), rv.copy()
    flipped[D - 1, D // 2] *= -1
    swapped[[1, D - 1]] = swapped[[D - 1, 1]]
    return {"rk_t": rk_t, "rv": rv, "4 rv": 4 * rv, "flipped": flipped, "swapped": swapped, "3 rk_t": 3 * rk_t}


@pytest.mark.parametrize("D", [4, 8, 16, 64, 128, 256])
def test_rotations_of_a_rotated_cache_match_float64(D):
    rng = np.random.default_rng(D)
    x = mx.array(rng.standard_normal((2, 3, 5, D)).astype(np.float32) * 3)
    for name, r in signed_hadamards(rng, D).items():
        want = np.array(x).astype(np.float64) @ r.astype(np.float64)
        for dtype in DTYPES.values():
            got = _ext.rotate_rows(x.astype(dtype), mx.array(r), mx.float32)
            want_d = as_np(x.astype(dtype)).astype(np.float64) @ r.astype(np.float64)
            np.testing.assert_array_equal(as_np(got), want_d.astype(np.float32), err_msg=f"{name}, {dtype}")
        # the packed write rotates its rows the same way
        buffers = (mx.zeros((2, 3, 6, D * 4 // 32), mx.uint32), mx.zeros((2, 3, 6, D // 32)), mx.zeros((2, 3, 6, D // 32)))
        if D % 32 == 0:
            out = _ext.quantize_rows_into(*buffers, x, 1, mx.array(r), 4, 32)
            for got, ref in zip(out, quantize_reference(want.astype(np.float32), 4, 32)):
                np.testing.assert_array_equal(as_np(got)[:, :, 1:6], ref, err_msg=name)


def test_rotate_rows_rejects_bad_input_and_takes_derivatives_from_its_definition():
    with pytest.raises(ValueError, match="rotation must be a float32 \\(8, 8\\)"):
        _ext.rotate_rows(mx.zeros((2, 8)), mx.zeros((8, 4)), mx.float32)
    with pytest.raises(ValueError, match="rotation must be"):
        _ext.rotate_rows(mx.zeros((2, 8)), mx.zeros((8, 8), mx.float16), mx.float32)
    with pytest.raises(ValueError, match="x must be"):
        _ext.rotate_rows(mx.zeros((2, 8), mx.int32), mx.zeros((8, 8)), mx.float32)
    with pytest.raises(ValueError, match="dtype must be"):
        _ext.rotate_rows(mx.zeros((2, 8)), mx.zeros((8, 8)), mx.int32)
    rng = np.random.default_rng(2)
    x, r = (mx.array(rng.standard_normal(s).astype(np.float32)) for s in ((3, 8), (8, 8)))
    w = mx.array(rng.standard_normal((3, 8)).astype(np.float32))
    grads = mx.grad(lambda x, r: (_ext.rotate_rows(x, r, mx.float32) * w).sum(), argnums=(0, 1))(x, r)
    np.testing.assert_allclose(np.array(grads[0]), np.array(w @ r.T), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(grads[1]), np.array(x.T @ w), rtol=1e-5, atol=1e-5)


def quantize_reference(y: np.ndarray, bits: int, group: int):
    """MLX's affine quantization of float32 rows y (..., D) in NumPy float32, the same operations
    in the same order: (words uint32, scales, biases) as float32 arrays."""
    n_bins = np.float32(2**bits - 1)
    g = y.reshape(*y.shape[:-1], -1, group).astype(np.float32)
    w_max, w_min = g.max(-1), g.min(-1)
    mask = np.abs(w_min) > np.abs(w_max)
    scale = np.maximum((w_max - w_min) / n_bins, np.float32(1e-7))
    scale = np.where(mask, scale, -scale)
    edge = np.where(mask, w_min, w_max)
    q0 = np.rint(edge / scale)
    nonzero = q0 != 0
    scale = np.where(nonzero, edge / np.where(nonzero, q0, 1), scale).astype(np.float32)
    bias = np.where(nonzero, edge, 0).astype(np.float32)
    q = np.clip(np.rint((g - bias[..., None]) / scale[..., None]), 0, n_bins).astype(np.uint64)
    per_word = 32 // bits
    q = q.reshape(*y.shape[:-1], -1, per_word)
    words = (q << (np.arange(per_word, dtype=np.uint64) * bits)).sum(-1).astype(np.uint32)
    return words, scale, bias


def as_np(a: mx.array) -> np.ndarray:
    return np.array(a if a.dtype in (mx.uint32, mx.float32) else a.astype(mx.float32))


def random_case(rng, dtype, bits, group, large=False):
    """x, the buffers (of `dtype`; x in a random float dtype) and the row to write at; `large`:
    buffers past QuantizeRowsInto's one-primitive size (a primitive per buffer)."""
    B, H, n = (int(v) for v in rng.integers(1, 4, size=3))
    D = group * int(rng.integers(1, 3))
    C = n + int(rng.integers(0, 6)) + (3000 if large else 0)
    start = int(rng.integers(0, C - n + 1))
    x_dtype = list(DTYPES.values())[int(rng.integers(0, 3))]
    x = mx.array(rng.standard_normal((B, H, n, D)).astype(np.float32) * rng.uniform(0.01, 10)).astype(x_dtype)
    buffers = (mx.array(rng.integers(0, 2**32, (B, H, C, D * bits // 32), dtype=np.uint32)),
               *(mx.array(rng.standard_normal((B, H, C, D // group)).astype(np.float32)).astype(dtype) for _ in range(2)))
    return x, buffers, start


def rows_reference(x: mx.array, dtype, center, rotation) -> np.ndarray:
    """The rows quantize_rows_into packs, as float32 values of `dtype`: x rounded to it, less the
    centre (float32 arithmetic, rounded again), times the rotation (float64 sums, rounded to float32,
    then to dtype)."""
    def rounded(a: np.ndarray) -> np.ndarray:
        return as_np(mx.array(a.astype(np.float32)).astype(dtype))

    y = rounded(as_np(x))
    if center is not None:
        y = rounded(y - np.array(center))
    if rotation is not None:
        y = rounded((y.astype(np.float64) @ np.array(rotation).astype(np.float64)).astype(np.float32))
    return y


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("large", [False, True], ids=["one primitive", "a primitive per buffer"])
def test_quantize_rows_into_matches_a_numpy_reference_on_random_shapes(dtype, bits, large):
    rng = np.random.default_rng(bits + 10 * large)
    for trial in range(24 if not large else 8):
        group = (32, 64, 128)[trial % 3]
        x, buffers, start = random_case(rng, DTYPES[dtype], bits, group, large)
        B, H, n, D = x.shape
        rotation = mx.array(np.linalg.qr(rng.standard_normal((D, D)))[0].astype(np.float32)) if trial % 2 else None
        center = None
        if trial % 3 != 0:  # a mean key per (batch row, head), or one for all (broadcast)
            shape = (B, H, 1, D) if trial % 3 == 1 else (1, 1, 1, D)
            center = mx.array(rng.standard_normal(shape).astype(np.float32) * float(np.std(as_np(x))))
        before = [as_np(b) for b in buffers]
        if trial % 4 == 1:  # a transposed view of the scales: the op reads any strides
            s = buffers[1]
            buffers = (buffers[0], mx.array(np.ascontiguousarray(np.swapaxes(as_np(s), 0, 2))).astype(s.dtype).swapaxes(0, 2), buffers[2])
        if trial % 4 == 2:  # x as the model's values arrive: a (B, L, H, D) array transposed
            x = mx.array(np.ascontiguousarray(np.swapaxes(as_np(x), 1, 2))).astype(x.dtype).swapaxes(1, 2)
        out = _ext.quantize_rows_into(*buffers, x, start, rotation, bits, group, center)
        y = rows_reference(x, DTYPES[dtype], center, rotation)
        for got, was, ref in zip(out, before, quantize_reference(y, bits, group)):
            want = was.copy()
            want[:, :, start : start + n] = ref if got.dtype == mx.uint32 else as_np(mx.array(ref).astype(DTYPES[dtype]))
            np.testing.assert_array_equal(as_np(got), want)
        # and what mx.quantize makes of the same rows
        for got, ref in zip(out, mx.quantize(mx.array(y).astype(DTYPES[dtype]), group_size=group, bits=bits)):
            np.testing.assert_array_equal(as_np(got)[:, :, start : start + n], as_np(ref))


def test_quantize_rows_into_writes_small_buffers_with_one_primitive_and_large_ones_with_one_each():
    """One primitive with three outputs (copies) up to ONE_PRIMITIVE_MAX_BYTES, a primitive per buffer past it."""
    def primitives(C):
        buffers = [mx.zeros((1, 2, C, 8), mx.uint32), mx.zeros((1, 2, C, 1)), mx.zeros((1, 2, C, 1))]
        out = _ext.quantize_rows_into(*buffers, mx.ones((1, 2, 1, 32)), 0, None, 8, 32)
        return graph_primitives(*out)["QuantizeRowsInto"]

    assert primitives(100) == 1  # 2 x 100 x 40 bytes
    assert primitives(1000) == 3  # 80 KB


def test_quantize_rows_into_writes_in_place_only_unreferenced_buffers():
    x = mx.ones((1, 2, 1, 32))
    buffers = [mx.zeros((1, 2, 100, 8), mx.uint32), mx.zeros((1, 2, 100, 1)), mx.zeros((1, 2, 100, 1))]
    mx.eval(buffers)
    kept = buffers[1]
    out = _ext.quantize_rows_into(*buffers, x, 7, None, 8, 32)
    del buffers
    mx.eval(out)
    assert float(kept.sum()) == 0.0  # still referenced: copied, not written
    assert float(out[1][:, :, 7].sum()) != 0.0 and float(out[1].sum()) == float(out[1][:, :, 7].sum())

    # unreferenced (the cache's case, decode step after decode step): written in place, so the
    # process never holds a second copy of a buffer (one op per buffer: MLX never donates the
    # inputs of a primitive with several outputs)
    rows = 1 << 16
    buffers = [mx.zeros((1, 4, rows, 32), mx.uint32), mx.zeros((1, 4, rows, 4)), mx.zeros((1, 4, rows, 4))]
    buffers = [b + 0 for b in buffers]  # contiguous buffers of their own
    mx.eval(buffers)
    size = sum(b.nbytes for b in buffers)
    for step in range(3):
        buffers = _ext.quantize_rows_into(*buffers, mx.ones((1, 4, 1, 128)), step, None, 8, 32)
        held = mx.get_active_memory()  # the buffers, and whatever else the process holds
        mx.reset_peak_memory()
        mx.eval(buffers)
        assert mx.get_peak_memory() - held < 0.25 * size


def test_quantize_rows_into_derivatives_follow_its_definition():
    """vjp (and jvp, vmap) come from the stock-ops definition (QuantizeRowsInto::composed): centre,
    rotate, mx.quantize, slice_update."""
    rng = np.random.default_rng(3)
    x = mx.array(rng.standard_normal((1, 2, 3, 32)).astype(np.float32))
    rotation = mx.array(rng.standard_normal((32, 32)).astype(np.float32))
    center = mx.array(rng.standard_normal((1, 2, 1, 32)).astype(np.float32))
    buffers = [mx.zeros((1, 2, 5, 4), mx.uint32), mx.zeros((1, 2, 5, 1)), mx.zeros((1, 2, 5, 1))]
    weights = mx.arange(5, dtype=mx.float32)[:, None]

    def op(x):
        return (_ext.quantize_rows_into(*buffers, x, 1, rotation, 4, 32, center)[1] * weights).sum()

    def definition(x):
        _, scales, _ = mx.quantize((x - center) @ rotation, group_size=32, bits=4)
        return (mx.slice_update(buffers[1], scales, mx.array([0, 0, 1, 0]), axes=(0, 1, 2, 3)) * weights).sum()

    np.testing.assert_allclose(np.array(mx.grad(op)(x)), np.array(mx.grad(definition)(x)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "change, match",
    [(dict(bits=3), "bits must be 2, 4 or 8"), (dict(group_size=16), "group_size must be"),
     (dict(start=-1), "outside the buffers"), (dict(start=8), "outside the buffers"),
     (dict(x=(1, 2, 1, 48)), "does not divide"), (dict(x=(2, 2, 1, 32)), "packed must have shape"), (dict(packed=(1, 2, 8, 4)), "packed must have shape"),
     (dict(x=(2, 1, 32)), "array \\(B, H, n, D\\)"), (dict(scales=(1, 2, 8, 2)), "scales and biases must be float arrays"),
     (dict(rotation=(16, 16)), "rotation must be")],
)
def test_quantize_rows_into_rejects_bad_input(change, match):
    args = dict(packed=(1, 2, 8, 8), scales=(1, 2, 8, 1), biases=(1, 2, 8, 1), x=(1, 2, 1, 32), start=0, rotation=None,
                bits=8, group_size=32)
    args.update(change)
    arrays = {k: mx.zeros(args[k], mx.uint32 if k == "packed" else mx.float32) for k in ("packed", "scales", "biases", "x")}
    rotation = None if args["rotation"] is None else mx.zeros(args["rotation"])
    with pytest.raises(ValueError, match=match):
        _ext.quantize_rows_into(arrays["packed"], arrays["scales"], arrays["biases"], arrays["x"], args["start"], rotation,
                                args["bits"], args["group_size"])
    with pytest.raises(ValueError, match="float arrays of one dtype"):
        _ext.quantize_rows_into(mx.zeros((1, 2, 8, 8), mx.uint32), mx.zeros((1, 2, 8, 1), mx.float16),
                                mx.zeros((1, 2, 8, 1)), mx.zeros((1, 2, 1, 32)), 0, None, 8, 32)
    for center in (mx.zeros((1, 2, 2, 32)), mx.zeros((1, 3, 1, 32)), mx.zeros((1, 2, 1, 32), mx.float16), mx.zeros((2, 1, 32))):
        with pytest.raises(ValueError, match="center must be a float32"):
            _ext.quantize_rows_into(mx.zeros((1, 2, 8, 8), mx.uint32), mx.zeros((1, 2, 8, 1)), mx.zeros((1, 2, 8, 1)),
                                    mx.zeros((1, 2, 1, 32)), 0, None, 8, 32, center)


@pytest.mark.parametrize("bits", [None, 3, 4, 8, (8, 4)])
def test_rotated_store_keeps_the_rotated_rows_quantized(bits):
    """RotatedKV over a KVStore: what it holds, decoded, is quantize(x @ Rᵀ) whether the write was
    one primitive (2, 4, 8 bits) or stock ops (dense, 3 bits), over a prefill and decode steps."""
    rng = np.random.default_rng(5)
    store = RotatedKV(KVStore(bits), seed=3)
    xs = [mx.array(rng.standard_normal((1, 2, n, 32)).astype(np.float32)) for n in (9, 1, 1, 3, 1)]
    for x in xs:
        store.append(x, 2 * x)
    k_bits, v_bits = bits if isinstance(bits, tuple) else (bits, bits)
    k, v = store.inner.read_rows()
    for got, b, r, scale in ((k, k_bits, store.rotation.rk_t, 1), (v, v_bits, store.rotation.rv_t, 2)):
        y = mx.concatenate([(scale * x).astype(mx.float32) @ r for x in xs], axis=2)
        want = y if b is None else mx.dequantize(*mx.quantize(y, group_size=32, bits=b), group_size=32, bits=b)
        tol = 1e-6 if b is None else float(mx.abs(y).max()) / (2**b - 1) * 1.01
        np.testing.assert_allclose(np.array(got), np.array(want), atol=tol)
