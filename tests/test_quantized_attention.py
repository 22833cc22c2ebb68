"""Fused attention over packed K/V (and over several differently stored segments) against
dequantize-then-reference, for every bits / group size / scale dtype / mask / GQA shape."""

import itertools

import mlx.core as mx
import numpy as np
import pytest
from attention_reference import DTYPES, HEADS, check, make_inputs, random_mask

import mlx_h2o
from mlx_h2o import PackedKV, attention_with_scores

qsdpa = mlx_h2o.quantized_scaled_dot_product_attention_with_scores
BITS = [2, 3, 4, 5, 6, 8]
GROUPS = [32, 64, 128]


def numpy_dequantize(packed, scales, biases, bits, group_size):
    """MLX's affine format read independently in NumPy (float64): each row of uint32 words is a
    little-endian bit stream of `bits`-bit values; value = scale * q + bias per group."""
    words = np.array(packed)
    raw = np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little")  # (..., 32 * W) bits
    D = raw.shape[-1] // bits
    q = (raw[..., : D * bits].reshape(*raw.shape[:-1], D, bits) << np.arange(bits)).sum(-1)
    s = np.repeat(np.array(scales.astype(mx.float32), dtype=np.float64), group_size, axis=-1)
    b = np.repeat(np.array(biases.astype(mx.float32), dtype=np.float64), group_size, axis=-1)
    return s * q + b


def quantize(x, bits, group_size):
    """(triple, dequantized): the reference sees exactly the values stored (MLX's own dequantize
    rounds through the scales' dtype, so it is not used here)."""
    triple = mx.quantize(x, group_size=group_size, bits=bits)
    deq = numpy_dequantize(*triple, bits, group_size)
    # Sanity: the bit layout matches MLX's own decoder.
    mlx_deq = np.array(mx.dequantize(*triple, group_size=group_size, bits=bits).astype(mx.float32))
    ulp = {mx.float32: 2**-22, mx.float16: 2**-9, mx.bfloat16: 2**-6}[x.dtype]  # of MLX's rounding
    assert np.abs(deq - mlx_deq).max() <= ulp * max(1.0, np.abs(deq).max())
    return triple, mx.array(deq.astype(np.float32))


def int8_keys(n, bits):
    """Which of n packed keys the kernel dots with int8 queries (4-/8-bit ones, when enabled; never
    with MLX_H2O_OPS=mlx, whose mx.fast op keeps float32 queries)."""
    return np.full(n, bits in (4, 8) and mlx_h2o._ops.int8_queries())


def _quantized_fn(bits, group_size):
    def fn(q, kq, vq, **kw):
        return qsdpa(q, kq, vq, bits=bits, group_size=group_size, **kw)

    return fn


@pytest.mark.parametrize("bits,group_size", [(4, 32), (4, 64), (4, 128), (8, 32), (8, 64), (8, 128)])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_quantized_every_bits_group_dtype(bits, group_size, dtype):
    rng = np.random.default_rng(bits * 1000 + group_size)
    q, k, v = make_inputs(rng, 2, 9, 3, 3, 517, 128, DTYPES[dtype])
    kq, kd = quantize(k, bits, group_size)
    vq, vd = quantize(v, bits, group_size)
    check(q, kq, vq, 128**-0.5, "causal", fn=_quantized_fn(bits, group_size), ref_kv=(kd, vd), int8_keys=int8_keys(517, bits))


@pytest.mark.parametrize("D", [32, 96, 160])
def test_4bit_keys_in_pairs_and_a_lone_block(D):
    """AVX2 dots 4-bit keys two 32-column blocks at a time: head dims of 1, 3 and 5 blocks leave one alone."""
    rng = np.random.default_rng(D)
    q, k, v = make_inputs(rng, 1, 4, 2, 5, 300, D, mx.float32)
    kq, kd = quantize(k, 4, 32)
    vq, vd = quantize(v, 4, 32)
    check(q, kq, vq, D**-0.5, "causal", fn=_quantized_fn(4, 32), ref_kv=(kd, vd), int8_keys=int8_keys(300, 4))


def test_quantized_sweep_shapes_masks_and_other_bit_widths():
    """GQA shapes x lengths x masks, with the bit widths (2, 3, 5, 6) the rotated caches use too."""
    rng = np.random.default_rng(1)
    bits = itertools.cycle(BITS)
    groups = itertools.cycle(GROUPS)
    dtypes = itertools.cycle(DTYPES.values())
    masks = itertools.cycle([None, "causal", "bool", "additive"])
    for (Hq, Hkv), L, N in itertools.product(HEADS, [1, 7, 33], [1, 64, 1000]):
        b, g, dtype, kind = next(bits), next(groups), next(dtypes), next(masks)
        if kind == "causal" and L > N:
            kind = None
        B = 1 + (N % 2)
        q, k, v = make_inputs(rng, B, Hq, Hkv, L, N, 128, dtype)
        kq, kd = quantize(k, b, g)
        vq, vd = quantize(v, b, g)
        check(q, kq, vq, 0.09, random_mask(rng, kind, B, Hq, L, N), fn=_quantized_fn(b, g), ref_kv=(kd, vd),
              int8_keys=int8_keys(N, b))


@pytest.mark.parametrize("bits", [4, 8])
def test_float_queries_when_int8_is_off(bits):
    """set_attention_int8_queries(False): the exact (float32 query) path, against the plain reference."""
    rng = np.random.default_rng(12)
    q, k, v = make_inputs(rng, 1, 6, 2, 2, 300, 64, mx.float32)
    kq, kd = quantize(k, bits, 32)
    vq, vd = quantize(v, bits, 32)
    mlx_h2o._ext.set_attention_int8_queries(False)
    try:
        check(q, kq, vq, 0.125, "causal", fn=_quantized_fn(bits, 32), ref_kv=(kd, vd))
    finally:
        mlx_h2o._ext.set_attention_int8_queries(True)


def test_quantized_sinks_and_head_dim_64():
    rng = np.random.default_rng(2)
    q, k, v = make_inputs(rng, 1, 8, 2, 2, 300, 64, mx.float16)
    sinks = mx.array(rng.standard_normal(8).astype(np.float32))
    kq, kd = quantize(k, 4, 64)
    vq, vd = quantize(v, 4, 64)
    check(q, kq, vq, 0.125, "causal", sinks=sinks, fn=_quantized_fn(4, 64), ref_kv=(kd, vd), int8_keys=int8_keys(300, 4))


def test_strided_cache_views():
    """mlx-lm's QuantizedKVCache hands out views of a larger, step-allocated buffer."""
    rng = np.random.default_rng(3)
    q, k, v = make_inputs(rng, 1, 9, 3, 1, 700, 64, mx.float32)
    kq, kd = quantize(k, 8, 64)
    vq, vd = quantize(v, 8, 64)
    kq = tuple(a[:, :, :650] for a in kq)
    vq = tuple(a[:, :, :650] for a in vq)
    check(q, kq, vq, 0.125, None, fn=_quantized_fn(8, 64), ref_kv=(kd[:, :, :650], vd[:, :, :650]), int8_keys=int8_keys(650, 8))


def test_segments_mixed_formats():
    """8-bit heavy hitters + 4-bit recent window + a dense full-precision tail, K and V each in their
    own format, against the reference on the concatenated (dequantized) keys."""
    rng = np.random.default_rng(4)
    B, Hq, Hkv, L, D = 2, 9, 3, 4, 64
    q = make_inputs(rng, B, Hq, Hkv, L, 1, D, mx.float32)[0]
    lengths, formats = [300, 70, 16], [(8, 32), (4, 64), None]
    segments, ks, vs = [], [], []
    for n, fmt in zip(lengths, formats):
        _, k, v = make_inputs(rng, B, Hq, Hkv, L, n, D, mx.float16)
        if fmt is None:
            segments.append((k, v))
            ks.append(k.astype(mx.float32))
            vs.append(v.astype(mx.float32))
            continue
        (kq, kd), (vq, vd) = quantize(k, *fmt), quantize(v, fmt[0], 32)  # V at another group size
        segments.append((PackedKV(*kq, *fmt), PackedKV(*vq, fmt[0], 32)))
        ks.append(kd)
        vs.append(vd)
    ref_kv = (mx.concatenate(ks, axis=2), mx.concatenate(vs, axis=2))

    def fused(q, k, v, **kw):
        return attention_with_scores(q, segments, **kw)

    def composed(q, k, v, **kw):
        return attention_with_scores(q, segments, composed=True, **kw)

    fused_int8 = np.concatenate([int8_keys(300, 8), int8_keys(70, 4), np.zeros(16, bool)])
    for fn, keys in ((fused, fused_int8), (composed, None)):
        for mask in ("causal", random_mask(rng, "bool", B, Hq, L, sum(lengths))):
            check(q, None, None, D**-0.5, mask, fn=fn, ref_kv=ref_kv, int8_keys=keys)


def test_kivi_style_8bit_keys_4bit_values():
    rng = np.random.default_rng(6)
    q, k, v = make_inputs(rng, 1, 4, 4, 1, 999, 64, mx.bfloat16)
    kq, kd = quantize(k, 8, 32)
    vq, vd = quantize(v, 4, 64)

    def fn(q, k, v, **kw):
        return attention_with_scores(q, [(PackedKV(*kq, 8, 32), PackedKV(*vq, 4, 64))], **kw)

    check(q, None, None, 0.125, None, fn=fn, ref_kv=(kd, vd), int8_keys=int8_keys(999, 8))


def test_bad_quantized_input():
    rng = np.random.default_rng(0)
    q, k, v = make_inputs(rng, 1, 4, 2, 1, 10, 64, mx.float32)
    kq, vq = mx.quantize(k, group_size=64, bits=4), mx.quantize(v, group_size=64, bits=4)
    with pytest.raises(ValueError, match="bits must be one of"):
        qsdpa(q, kq, vq, scale=0.1, bits=7, group_size=64)
    with pytest.raises(ValueError, match="group_size must be one of"):
        qsdpa(q, kq, vq, scale=0.1, bits=4, group_size=16)
    with pytest.raises(ValueError, match="scales for group_size"):
        qsdpa(q, kq, vq, scale=0.1, bits=4, group_size=32)  # packed with 64
    with pytest.raises(ValueError, match="same head dim"):
        qsdpa(q, kq, vq, scale=0.1, bits=8, group_size=32)  # 4-bit words read as 8-bit: D=32
    with pytest.raises(ValueError, match="triple"):
        qsdpa(q, kq[:2], vq, scale=0.1, bits=4, group_size=64)
    with pytest.raises(ValueError, match="uint32"):
        qsdpa(q, (kq[0].astype(mx.int32), kq[1], kq[2]), vq, scale=0.1, bits=4, group_size=64)
    with pytest.raises(ValueError, match="disagree"):
        qsdpa(q, (kq[0][:, :, :5], kq[1], kq[2]), vq, scale=0.1, bits=4, group_size=64)
    with pytest.raises(ValueError, match="bits must be an integer"):
        qsdpa(q, kq, vq, scale=0.1, bits=4.0, group_size=64)
    with pytest.raises(ValueError, match="segments"):
        attention_with_scores(q, "kv", scale=0.1)
    with pytest.raises(ValueError, match="PackedKV"):
        attention_with_scores(q, [(kq, v)], scale=0.1)
    with pytest.raises(ValueError, match="at most 4"):
        attention_with_scores(q, [(k, v)] * 5, scale=0.1)
    for rows in (11, -2):  # a PackedKV reads at most its arrays' rows
        with pytest.raises(ValueError, match="rows must be -1"):
            attention_with_scores(q, [(PackedKV(*kq, 4, 64, rows), PackedKV(*vq, 4, 64))], scale=0.1)
    with pytest.raises(ValueError, match="k and v must agree"):
        attention_with_scores(q, [(PackedKV(*kq, 4, 64, 5), PackedKV(*vq, 4, 64, 6))], scale=0.1)
    with pytest.raises(ValueError, match="rows must be an integer"):
        attention_with_scores(q, [(PackedKV(*kq, 4, 64, 5.0), PackedKV(*vq, 4, 64))], scale=0.1)


def test_int8_queries_add_little_to_the_caches_own_error():
    """Model level (tiny llama, quantized cache): the int8 query rounding adds little to the error the
    packed K/V already make against a full-precision cache (measured: 4-bit +1%, 8-bit +26% mean)."""
    from mlx_lm.models import cache as lm_cache
    from tiny_models import tiny_model

    from attention_reference import float_queries

    model = tiny_model("llama", head_dim=64, hidden_size=128)
    tokens = mx.array(np.random.default_rng(1).integers(0, 101, 60))[None]

    def run(cache):
        outs = [model(tokens[:, :20], cache=cache)] + [model(tokens[:, t : t + 1], cache=cache) for t in range(20, 60)]
        return np.array(mx.concatenate(outs, axis=1))

    full = run(lm_cache.make_prompt_cache(model))
    for bits, allowed in ((4, 1.1), (8, 1.5)):
        int8 = np.abs(run(mlx_h2o.make_cache(model, "quantized", bits=bits, group_size=32)) - full).mean()
        with float_queries():
            exact = np.abs(run(mlx_h2o.make_cache(model, "quantized", bits=bits, group_size=32)) - full).mean()
        assert int8 <= allowed * exact, (bits, int8, exact)


@pytest.mark.parametrize("composed", [False, True])
def test_rows_read_a_buffer_in_place_as_its_slice(composed):
    """A PackedKV with `rows` (a cache's buffer with spare room) attends as the slice of those rows:
    the spare rows (NaN scales here) are never read, by the kernel or by the composed ops."""
    rng = np.random.default_rng(3)
    q, k, v = make_inputs(rng, 1, 6, 3, 1, 40, 64, mx.float32)
    kq, vq = mx.quantize(k, group_size=32, bits=4), mx.quantize(v, group_size=32, bits=8)
    spare = [mx.concatenate([a, mx.full((*a.shape[:2], 9, a.shape[3]), np.nan, a.dtype)], axis=2) if a.dtype != mx.uint32
             else mx.concatenate([a, mx.zeros((*a.shape[:2], 9, a.shape[3]), a.dtype)], axis=2) for a in (*kq, *vq)]
    in_place = [(PackedKV(*spare[:3], 4, 32, 40), PackedKV(*spare[3:], 8, 32, 40))]
    sliced = [(PackedKV(*kq, 4, 32), PackedKV(*vq, 8, 32))]
    got = attention_with_scores(q, in_place, scale=0.125, scores="mass", composed=composed)
    want = attention_with_scores(q, sliced, scale=0.125, scores="mass", composed=composed)
    for g, w in zip(got, want):
        assert g.shape == w.shape and np.array_equal(np.array(g), np.array(w))


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_rotations_inside_the_op_equal_rotate_rows_around_it(dtype):
    """q_rotation / out_rotation (a rotated cache's queries and output) give bit for bit what
    rotate_rows before and after the op gives, scores included; the composed ops agree with the
    composed op around rotate_rows' definition."""
    rng = np.random.default_rng(11)
    q, k, v = make_inputs(rng, 2, 6, 3, 3, 50, 64, dtype)
    rq, ro = (mx.array(np.linalg.qr(rng.standard_normal((64, 64)))[0].astype(np.float32)) for _ in range(2))
    segments = [(PackedKV(*mx.quantize(k[:, :, :30], group_size=32, bits=4), 4, 32), PackedKV(*mx.quantize(v[:, :, :30], group_size=32, bits=8), 8, 32)),
                (k[:, :, 30:], v[:, :, 30:])]
    strided = mx.contiguous(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)  # (B, Hq, L, D) as a model's transpose gives it
    for queries in (q, strided):
        out, mass = attention_with_scores(queries, segments, scale=0.125, mask="causal", q_rotation=rq, out_rotation=ro)
        inner, want_mass = attention_with_scores(mlx_h2o._ext.rotate_rows(q, rq, mx.float32), segments, scale=0.125, mask="causal")
        want = mlx_h2o._ext.rotate_rows(inner, ro, dtype)
        assert out.dtype == dtype and np.array_equal(np.array(out.astype(mx.float32)), np.array(want.astype(mx.float32)))
        assert np.array_equal(np.array(mass), np.array(want_mass))
    c_out, c_mass = attention_with_scores(q, segments, scale=0.125, mask="causal", q_rotation=rq, out_rotation=ro, composed=True)
    c_inner, c_want_mass = attention_with_scores(q.astype(mx.float32) @ rq, segments, scale=0.125, mask="causal", composed=True)
    tol = 1e-5 if dtype == mx.float32 else 1e-2
    np.testing.assert_allclose(np.array(c_out.astype(mx.float32)), np.array(((c_inner @ ro).astype(dtype)).astype(mx.float32)), atol=tol, rtol=tol)
    np.testing.assert_allclose(np.array(c_mass), np.array(c_want_mass), atol=1e-5)


def test_bad_rotations():
    rng = np.random.default_rng(0)
    q, k, v = make_inputs(rng, 1, 4, 2, 1, 10, 64, mx.float32)
    with pytest.raises(ValueError, match=r"q_rotation must be a float32 \(64, 64\)"):
        attention_with_scores(q, [(k, v)], scale=0.1, q_rotation=mx.zeros((32, 32)))
    with pytest.raises(ValueError, match=r"out_rotation must be a float32 \(64, 64\)"):
        attention_with_scores(q, [(k, v)], scale=0.1, out_rotation=mx.zeros((64, 64), mx.float16))
    with pytest.raises(ValueError, match="q_rotation must be None or"):
        attention_with_scores(q, [(k, v)], scale=0.1, q_rotation=np.eye(64))
