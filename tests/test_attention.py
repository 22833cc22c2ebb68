"""`scaled_dot_product_attention_with_scores` against a float64 NumPy reference.

Random inputs (never zeros), every head ratio / length / head dim / dtype / mask kind of the spec,
non-contiguous inputs, sinks, the composed (GPU-stream) path, the portable kernel variant and other
thread counts (in subprocesses, since both are fixed per process), and clear errors for bad input.
"""

import itertools
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from attention_reference import DTYPES, HEAD_DIMS, HEADS, LENGTHS, SIZES, _f64, check, make_inputs, random_mask, randn, sdpa

import mlx_h2o
from mlx_h2o.attention import attention_with_scores_composed

def test_sweep_heads_lengths_sizes():
    """Every (head ratio, L, N) of the spec; D, dtype, mask kind and B rotate through their values."""
    rng = np.random.default_rng(0)
    dtypes = itertools.cycle(DTYPES.values())
    dims = itertools.cycle(HEAD_DIMS)
    masks = itertools.cycle([None, "causal", "bool", "additive", "additive-f16"])
    for i, ((Hq, Hkv), L, N) in enumerate(itertools.product(HEADS, LENGTHS, SIZES)):
        B, D, dtype, kind = 1 + i % 2, next(dims), next(dtypes), next(masks)
        if kind == "causal" and L > N:
            kind = None
        if N * L * Hq * D > 2e7:  # keep the float64 reference quick
            D = 64
        q, k, v = make_inputs(rng, B, Hq, Hkv, L, N, D, dtype)
        mask = random_mask(rng, kind, B, Hq, L, N)
        mass = check(q, k, v, D**-0.5, mask)
        # Every row attends to at least one key here, so each kv head's mass sums to G * L.
        np.testing.assert_allclose(mass.sum(-1), (Hq // Hkv) * L, rtol=1e-4)


@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_every_head_dim_and_dtype(D, dtype):
    rng = np.random.default_rng(D)
    q, k, v = make_inputs(rng, 2, 9, 3, 3, 700, D, DTYPES[dtype])
    check(q, k, v, D**-0.5, "causal")


@pytest.mark.parametrize("kind", ["bool", "additive", "additive-f16"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_every_mask_kind_and_dtype(kind, dtype):
    rng = np.random.default_rng(7)
    B, Hq, Hkv, L, N = 2, 8, 2, 5, 300
    q, k, v = make_inputs(rng, B, Hq, Hkv, L, N, 64, DTYPES[dtype])
    check(q, k, v, 0.125, random_mask(rng, kind, B, Hq, L, N))


def test_large_logits_and_scale():
    """Large-magnitude logits stress the online softmax's running max and rescaling."""
    rng = np.random.default_rng(3)
    q = randn(rng, (1, 4, 2, 64), mx.float32, scale=4.0)
    k = randn(rng, (1, 2, 2000, 64), mx.float32, scale=4.0)
    v = randn(rng, (1, 2, 2000, 64), mx.float32)
    check(q, k, v, 0.5)


def test_non_contiguous_inputs():
    rng = np.random.default_rng(11)
    B, Hq, Hkv, L, N, D = 2, 6, 2, 3, 257, 64
    # (B, L, H, D) storage seen as (B, H, L, D): strided heads and rows, unit-stride last axis.
    q = randn(rng, (B, L, Hq, D), mx.float16).swapaxes(1, 2)
    k = randn(rng, (B, N, Hkv, D), mx.float16).swapaxes(1, 2)
    # Last axis not unit-stride: (B, H, D, N) storage seen as (B, H, N, D) (copied once by the op).
    v = randn(rng, (B, Hkv, D, N), mx.float16).swapaxes(2, 3)
    # A slice of a longer cache, as mlx-lm's KVCache hands out.
    k_big = randn(rng, (B, Hkv, N + 50, D), mx.float16)
    check(q, k, v, D**-0.5, "causal")
    check(q, k_big[:, :, 10 : 10 + N], v, D**-0.5, None)
    mask = mx.array(rng.random((B, Hq, N, L)) < 0.9).swapaxes(2, 3)  # strided mask
    mask[..., 0] = True
    check(q, k, v, D**-0.5, mask)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("mask_kind", [None, "causal", "bool"])
def test_leading_rows_read_in_place(dtype, mask_kind):
    """`rows=n` reads the first n rows of a buffer with spare room (a cache's): the float64 reference
    over those rows, and bit for bit the call on the slice."""
    rng = np.random.default_rng(13)
    B, Hq, Hkv, L, N, D = 2, 6, 2, 3, 150, 64
    q, k, v = make_inputs(rng, B, Hq, Hkv, L, N + 40, D, DTYPES[dtype])  # 40 rows past the ones in use: random, never read
    mask = random_mask(rng, "bool", B, Hq, L, N) if mask_kind == "bool" else mask_kind
    in_place = lambda q, k, v, **kw: sdpa(q, k, v, rows=N, **kw)  # noqa: E731
    mass = check(q, k, v, D**-0.5, mask, fn=in_place, ref_kv=(k[:, :, :N], v[:, :, :N]))
    assert mass.shape == (B, Hkv, N)
    for a, b in zip(sdpa(q, k, v, scale=D**-0.5, mask=mask, rows=N), sdpa(q, k[:, :, :N], v[:, :, :N], scale=D**-0.5, mask=mask)):
        np.testing.assert_array_equal(_f64(a), _f64(b))


def test_dense_rows_segments_read_buffers_in_place():
    """DenseRows(buffer, n) as a segment's K or V (what an h2o store's dense rows attend as): bit for
    bit the call on the buffers' slices, alone and after another segment; a bad row count is an error."""
    from mlx_h2o.attention import DenseRows, attention_with_scores

    rng = np.random.default_rng(14)
    q, k, v = make_inputs(rng, 1, 6, 2, 1, 90, 64, mx.float32)
    _, k0, v0 = make_inputs(rng, 1, 6, 2, 1, 30, 64, mx.float32)
    for segments, sliced in [([(DenseRows(k, 70), DenseRows(v, 70))], [(k[:, :, :70], v[:, :, :70])]),
                             ([(k0, v0), (DenseRows(k, 55), DenseRows(v, 55))], [(k0, v0), (k[:, :, :55], v[:, :, :55])])]:
        for a, b in zip(attention_with_scores(q, segments, scale=0.125), attention_with_scores(q, sliced, scale=0.125)):
            np.testing.assert_array_equal(_f64(a), _f64(b))
    with pytest.raises(ValueError, match="rows"):
        mx.eval(attention_with_scores(q, [(DenseRows(k, 91), DenseRows(v, 91))], scale=0.125)[0])
    with pytest.raises(ValueError, match="rows must be an integer"):
        attention_with_scores(q, [(DenseRows(k, 1.5), DenseRows(v, 2))], scale=0.125)


@pytest.mark.parametrize("rising", [False, True])
def test_mass_over_key_splits_and_segment_cut_tiles(rising):
    """The mass of decode rows whose keys are split across threads, in segments whose ends cut tiles
    short, and with a running max that rises from tile to tile (`rising`: later keys score higher),
    so every split's partial softmax is rescaled when they combine. Against the float64 reference,
    with and without masks and sinks."""
    from mlx_h2o.attention import DenseRows, attention_with_scores

    rng = np.random.default_rng(15)
    lengths, B, Hq, Hkv, D = [37, 700, 5, 691], 2, 9, 3, 64
    N = sum(lengths)
    q, k, v = make_inputs(rng, B, Hq, Hkv, 1, N, D, mx.float16)
    if rising:  # keys along q's mean direction, growing with the position
        direction = np.array(q.astype(mx.float32)).reshape(B, Hkv, Hq // Hkv, D).mean(axis=2)[:, :, None, :]
        k = (k.astype(mx.float32) + mx.array(direction * np.linspace(0, 6, N)[None, None, :, None].astype(np.float32))).astype(mx.float16)
    bounds = np.cumsum([0] + lengths)
    spare = [mx.concatenate([x[:, :, a:b], randn(rng, (B, Hkv, 3, D), mx.float16)], axis=2) for a, b in zip(bounds, bounds[1:]) for x in (k, v)]
    segments = [(DenseRows(spare[2 * i], n), DenseRows(spare[2 * i + 1], n)) if i % 2 else (k[:, :, a:b], v[:, :, a:b])
                for i, (n, a, b) in enumerate(zip(lengths, bounds, bounds[1:]))]

    def fused(q, k, v, **kw):
        return attention_with_scores(q, segments, **kw)

    for mask, sinks in [(None, None), (random_mask(rng, "bool", B, Hq, 1, N), None), (None, randn(rng, (Hq,), mx.float32))]:
        check(q, None, None, D**-0.5, mask, sinks, fn=fused, ref_kv=(k, v))


@pytest.mark.parametrize("rows", [-1, 191, 1.5, True])
def test_bad_leading_rows(rows):
    q, k, v = make_inputs(np.random.default_rng(0), 1, 2, 1, 1, 190, 64, mx.float32)
    with pytest.raises(ValueError, match="rows"):
        mx.eval(sdpa(q, k, v, scale=0.125, rows=rows))


def test_value_head_dim_may_differ():
    """MLA (deepseek_v3) attends with 192-dim keys and 128-dim values."""
    rng = np.random.default_rng(5)
    q, k, v = make_inputs(rng, 1, 4, 4, 3, 100, 192, mx.float32, Dv=128)
    check(q, k, v, 192**-0.5, "causal")


def test_sinks():
    rng = np.random.default_rng(9)
    q, k, v = make_inputs(rng, 2, 8, 2, 4, 333, 64, mx.bfloat16)
    sinks = mx.array(rng.standard_normal(8).astype(np.float32) * 3)
    mass = check(q, k, v, 0.125, "causal", sinks=sinks)
    assert np.all(mass.sum(-1) < 4 * 4)  # the sink took some of each row's probability


def test_fully_masked_rows_give_zeros():
    rng = np.random.default_rng(2)
    q, k, v = make_inputs(rng, 1, 2, 1, 3, 50, 64, mx.float32)
    m = np.ones((1, 1, 3, 50), bool)
    m[..., 1, :] = False  # query row 1 sees nothing
    out, mass = sdpa(q, k, v, scale=0.125, mask=mx.array(m))
    assert np.all(np.array(out)[:, :, 1] == 0)
    np.testing.assert_allclose(np.array(mass).sum(), 2 * 2, rtol=1e-5)
    check(q, k, v, 0.125, mx.array(m))


@pytest.mark.parametrize("seed", range(6))
def test_composed_path_matches_reference(seed):
    """The composed ops GPU streams run, checked here on the CPU."""
    rng = np.random.default_rng(100 + seed)
    Hq, Hkv = HEADS[seed % 4]
    L, N = LENGTHS[seed % 4], SIZES[1 + seed % 4]
    dtype = list(DTYPES.values())[seed % 3]
    q, k, v = make_inputs(rng, 1 + seed % 2, Hq, Hkv, L, N, 64, dtype)
    kind = [None, "causal", "bool", "additive"][seed % 4]
    if kind == "causal" and L > N:
        kind = None
    sinks = mx.array(rng.standard_normal(Hq).astype(np.float32)) if seed % 3 == 0 else None
    check(q, k, v, 0.125, random_mask(rng, kind, 1 + seed % 2, Hq, L, N), sinks=sinks, fn=attention_with_scores_composed)


def test_gpu_stream_uses_composed_path():
    if not mx.metal.is_available() and not mx.cuda.is_available():
        pytest.skip("no GPU backend here")
    rng = np.random.default_rng(4)
    q, k, v = make_inputs(rng, 1, 4, 2, 3, 90, 64, mx.float32)
    check(q, k, v, 0.125, "causal", fn=lambda *a, **kw: sdpa(*a, **kw, stream=mx.gpu))


_SUBPROCESS_SWEEP = """
import sys; sys.path[:0] = {path!r}
import numpy as np, mlx.core as mx
import attention_reference as t
import mlx_h2o
assert mlx_h2o._ext.kernel_isa() == {isa!r}, mlx_h2o._ext.kernel_isa()
rng = np.random.default_rng(1)
for (Hq, Hkv), L, N, dtype in [((9, 3), 1, 4099, mx.float16), ((4, 1), 33, 1000, mx.bfloat16),
                               ((8, 8), 7, 64, mx.float32), ((1, 1), 2, 5, mx.float16)]:
    q, k, v = t.make_inputs(rng, 2, Hq, Hkv, L, N, 80, dtype)
    t.check(q, k, v, 0.1, "causal" if L <= N else None)
    t.check(q, k, v, 0.1, t.random_mask(rng, "bool", 2, Hq, L, N))
print("ok")
"""


@pytest.mark.parametrize(
    "env,isa",
    [({"MLX_H2O_KERNEL_ISA": "portable"}, "portable"), ({"MLX_H2O_NUM_THREADS": "1"}, None), ({"MLX_H2O_NUM_THREADS": "3"}, None)],
)
def test_other_kernel_variants_and_thread_counts(env, isa):
    isa = isa or mlx_h2o._ext.kernel_isa()
    path = [os.path.dirname(__file__)] + [p for p in sys.path if p]
    code = _SUBPROCESS_SWEEP.format(path=path, isa=isa)
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


# ---------------------------------------------------------------------------------------------
# Bad input: a ValueError that names the argument.


def _ok_inputs():
    rng = np.random.default_rng(0)
    return make_inputs(rng, 1, 4, 2, 3, 10, 64, mx.float32)


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda q, k, v: (q[0], k, v), "q must have 4 dimensions"),
        (lambda q, k, v: (q, k[0], v), "must have 4 dimensions \\(B, Hkv"),
        (lambda q, k, v: (q.astype(mx.int32), k, v), "q's dtype"),
        (lambda q, k, v: (q, k.astype(mx.int32), v), "dtype must be float32"),
        (lambda q, k, v: (q, k, v.astype(mx.uint8)), "dtype must be float32"),
        (lambda q, k, v: (q[:, :3], k, v), "multiple of the number of kv heads"),
        (lambda q, k, v: (q[..., :32], k, v), "same head dim"),
        (lambda q, k, v: (mx.concatenate([q, q]), k, v), "same batch size"),
        (lambda q, k, v: (q, k, v[:, :, :5]), "agree on"),
        (lambda q, k, v: (q, k[:, :, :0], v[:, :, :0]), ">= 1"),
    ],
)
def test_bad_shapes_and_dtypes(change, match):
    q, k, v = change(*_ok_inputs())
    with pytest.raises(ValueError, match=match):
        sdpa(q, k, v, scale=0.1)


def test_bad_masks_scores_sinks_scale():
    q, k, v = _ok_inputs()
    with pytest.raises(ValueError, match="mask must be None, 'causal' or an mx.array"):
        sdpa(q, k, v, scale=0.1, mask="sliding")
    with pytest.raises(ValueError, match="mask must be None, 'causal' or an mx.array"):
        sdpa(q, k, v, scale=0.1, mask=np.ones((3, 10), bool))
    with pytest.raises(ValueError, match="does not broadcast"):
        sdpa(q, k, v, scale=0.1, mask=mx.ones((3, 11), mx.bool_))
    with pytest.raises(ValueError, match="does not broadcast"):
        sdpa(q, k, v, scale=0.1, mask=mx.ones((1, 1, 1, 3, 10), mx.bool_))
    with pytest.raises(ValueError, match="boolean or additive"):
        sdpa(q, k, v, scale=0.1, mask=mx.ones((3, 10), mx.int32))
    with pytest.raises(ValueError, match="causal mask needs L <= N"):
        sdpa(q, k[:, :, :2], v[:, :, :2], scale=0.1, mask="causal")
    with pytest.raises(ValueError, match="scores must be one of"):
        sdpa(q, k, v, scale=0.1, scores="probs")
    with pytest.raises(ValueError, match="sinks must have shape"):
        sdpa(q, k, v, scale=0.1, sinks=mx.zeros((3,)))
    with pytest.raises(ValueError, match="sinks' dtype"):
        sdpa(q, k, v, scale=0.1, sinks=mx.zeros((4,), mx.int32))
    with pytest.raises(ValueError, match="scale must be"):
        sdpa(q, k, v, scale=float("inf"))
    with pytest.raises(ValueError, match="scale must be"):
        sdpa(q, k, v, scale="0.1")


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_a_query_row_gets_the_same_result_in_any_call(dtype):
    """Bit-for-bit: a row's output does not depend on how many other rows share its call or where
    the keys end past what it sees (chunked prefill equals one-shot prefill). Key ranges stay below
    the length at which decode splits keys across threads."""
    rng = np.random.default_rng(11)
    for Hq, Hkv, N, D in [(2, 1, 4, 16), (8, 2, 64, 64), (9, 3, 200, 64), (4, 4, 37, 24), (6, 2, 130, 80)]:
        q, k, v = (mx.array(rng.standard_normal(s).astype(np.float32)).astype(dtype)
                   for s in ((1, Hq, N, D), (1, Hkv, N, D), (1, Hkv, N, D)))
        whole = mlx_h2o.scaled_dot_product_attention_with_scores(q, k, v, scale=D**-0.5, mask="causal", scores=None)[0]
        for L in sorted({1, 2, 3, 5, 7, N // 2, N - 1}):
            tail = mlx_h2o.scaled_dot_product_attention_with_scores(q[:, :, N - L :], k, v, scale=D**-0.5, mask="causal", scores=None)[0]
            head = mlx_h2o.scaled_dot_product_attention_with_scores(
                q[:, :, :L], k[:, :, :L], v[:, :, :L], scale=D**-0.5, mask="causal", scores=None
            )[0]
            assert mx.array_equal(tail, whole[:, :, N - L :]), (Hq, Hkv, N, D, L)
            assert mx.array_equal(head, whole[:, :, :L]), (Hq, Hkv, N, D, L)
