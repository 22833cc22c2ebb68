"""Seeded random cases of the fused attention kernel against the float64 reference.

Each case draws a shape (batch, GQA ratio, query rows 1..80 around the 64-key tile and 32-row block,
keys 1..400, head dims incl. ones not a multiple of 8, a value head dim that may differ), a dtype, a
mask (none, causal, boolean, additive in three dtypes, incl. fully-masked rows), optional sinks, a
score mode, and 1-3 key segments each dense or packed (bits 2-8, groups 32/64/128, K and V in their
own formats; packed ones sometimes in buffers with spare rows of NaN scales, read up to `rows`). The reference rounds the queries as the kernel does where it dots them in int8 (packed
4-/8-bit keys). A case mismatches when any output leaves the tolerance of its dtype; the test wants 0.

MLX_H2O_FUZZ_CASES (default 1000) scales the case count for longer local runs; MLX_H2O_FUZZ_SEED
(default 0) picks another stream of cases.
"""

import os

import mlx.core as mx
import numpy as np
import pytest
from attention_reference import OUT_TOL, _f64, reference
from test_quantized_attention import numpy_dequantize

from mlx_h2o import PackedKV, _ops, attention_with_scores

CASES = int(os.environ.get("MLX_H2O_FUZZ_CASES", "1000"))
SEED = int(os.environ.get("MLX_H2O_FUZZ_SEED", "0"))
DTYPE_NAMES = {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16"}
BITS = [2, 3, 4, 5, 6, 8]
GROUPS = [32, 64, 128]


def _pick(rng, options, p=None):
    return options[rng.choice(len(options), p=p)]


def _array(rng, shape, dtype, scale=1.0):
    return mx.array((scale * rng.standard_normal(shape)).astype(np.float32)).astype(dtype)


def _source(rng, x, packed_fmt):
    """(kernel input, float64-exact dense values) of one K or V segment."""
    if packed_fmt is None:
        return x, x
    bits, group = packed_fmt
    triple = mx.quantize(x, group_size=group, bits=bits)
    dense = mx.array(numpy_dequantize(*triple, bits, group).astype(np.float32))
    if rng.random() < 0.3:  # a cache's buffer with spare room, read in place (`rows`): NaN if read
        n, spare = x.shape[2], int(rng.integers(1, 40))
        triple = [mx.concatenate([a, mx.full((*a.shape[:2], spare, a.shape[3]), np.nan if a.dtype != mx.uint32 else 0xFFFFFFFF, a.dtype)], axis=2)
                  for a in triple]
        return PackedKV(*triple, bits, group, n), dense
    return PackedKV(*triple, bits, group), dense


def draw_case(rng):
    dtype = _pick(rng, [mx.float32, mx.float16, mx.bfloat16])
    B = int(rng.integers(1, 3))
    Hkv = _pick(rng, [1, 2, 4])
    Hq = Hkv * _pick(rng, [1, 2, 3, 4, 8])
    L = int(_pick(rng, [1, 1, 2, 3, 5, 8, 17, 31, 33, 64, 65, 80]))
    n_seg = int(_pick(rng, [1, 1, 2, 3]))
    packed = [(rng.random() < 0.5, rng.random() < 0.5) for _ in range(n_seg)]  # (k packed, v packed)
    any_k, any_v = any(k for k, _ in packed), any(v for _, v in packed)
    # Packed rows need whole groups: head dims a multiple of the largest group used.
    k_groups = [_pick(rng, GROUPS) for _ in range(n_seg)]
    v_groups = [_pick(rng, GROUPS) for _ in range(n_seg)]
    if any_k:
        Dk = int(_pick(rng, [128, 256])) if max(k_groups) == 128 else int(_pick(rng, [64, 128, 192]))
    else:
        Dk = int(_pick(rng, [1, 3, 8, 13, 16, 31, 40, 64, 67, 80, 96, 100, 128, 160]))
    if any_v:
        Dv = int(_pick(rng, [128, 256])) if max(v_groups) == 128 else int(_pick(rng, [64, 128]))
    else:
        Dv = Dk if rng.random() < 0.7 else int(_pick(rng, [5, 16, 24, 57, 64, 96]))
    # Keep groups dividing the head dims drawn.
    k_groups = [g if Dk % g == 0 else 32 for g in k_groups]
    v_groups = [g if Dv % g == 0 else 32 for g in v_groups]
    lengths = [int(rng.integers(1, 200 if n_seg > 1 else 400)) for _ in range(n_seg)]
    N = sum(lengths)
    q = _array(rng, (B, Hq, L, Dk), dtype, scale=float(_pick(rng, [0.5, 1.0, 3.0])))
    segments, ks, vs, int8_keys = [], [], [], []
    int8_on = _ops.int8_queries()
    for i, n in enumerate(lengths):
        k = _array(rng, (B, Hkv, n, Dk), dtype)
        v = _array(rng, (B, Hkv, n, Dv), dtype)
        k_bits = int(_pick(rng, BITS))
        int8_keys.append(np.full(n, int8_on and packed[i][0] and k_bits in (4, 8)))
        kin, kd = _source(rng, k, (k_bits, k_groups[i]) if packed[i][0] else None)
        vin, vd = _source(rng, v, (int(_pick(rng, BITS)), v_groups[i]) if packed[i][1] else None)
        segments.append((kin, vin))
        ks.append(kd)
        vs.append(vd)
    kind = _pick(rng, ["none", "causal", "bool", "additive"])
    if kind == "causal" and L > N:
        kind = "none"
    mask = None
    if kind == "causal":
        mask = "causal"
    elif kind == "bool":
        m = rng.random((B if rng.random() < 0.5 else 1, Hq if rng.random() < 0.5 else 1, L, N)) < rng.uniform(0.3, 0.95)
        if rng.random() < 0.3:
            m[..., int(rng.integers(0, L)), :] = False  # a fully masked row
        mask = mx.array(m)
    elif kind == "additive":
        a = rng.standard_normal((L, N)).astype(np.float32) * 2
        if rng.random() < 0.3:
            a[int(rng.integers(0, L))] = -np.inf  # a fully masked row
        mask = mx.array(a).astype(_pick(rng, [mx.float32, mx.float16, mx.bfloat16]))
    sinks = _array(rng, (Hq,), _pick(rng, [mx.float32, mx.bfloat16])) if rng.random() < 0.25 else None
    scores = _pick(rng, ["mass", "logits", None])
    scale = float(Dk**-0.5 * rng.uniform(0.5, 2.0))
    desc = (f"B={B} Hq={Hq} Hkv={Hkv} L={L} N={lengths} Dk={Dk} Dv={Dv} {DTYPE_NAMES[dtype]} mask={kind} "
            f"sinks={sinks is not None} scores={scores} packed={packed}")
    ref_kv = (mx.concatenate(ks, axis=2), mx.concatenate(vs, axis=2))
    return dict(q=q, segments=segments, ref_kv=ref_kv, mask=mask, sinks=sinks, scores=scores, scale=scale, desc=desc,
                int8_keys=np.concatenate(int8_keys))


def mismatch(case):
    """None if the kernel agrees with the float64 reference, else what differs."""
    q = case["q"]
    tol = OUT_TOL[DTYPE_NAMES[q.dtype]]
    out, sc = attention_with_scores(q, case["segments"], scale=case["scale"], mask=case["mask"],
                                    sinks=case["sinks"], scores=case["scores"])
    ref_out, ref_mass, ref_logits = reference(q, *case["ref_kv"], case["scale"], case["mask"], case["sinks"], case["int8_keys"])
    if out.dtype != q.dtype or out.shape != ref_out.shape:
        return f"out {out.dtype} {out.shape} vs {ref_out.shape}"
    err = np.abs(_f64(out) - ref_out) - tol * (1 + np.abs(ref_out))
    if not np.all(err <= 0):
        return f"out off by {np.nanmax(np.abs(_f64(out) - ref_out)):.3g}"
    if case["scores"] == "mass":
        got = np.array(sc)
        if got.shape != ref_mass.shape or not np.allclose(got, ref_mass, atol=2e-5 * max(1, q.shape[2]), rtol=1e-4):
            return f"mass off by {np.abs(got - ref_mass).max():.3g}"
    elif case["scores"] == "logits":
        got = np.array(sc)
        finite = np.isfinite(ref_logits)
        if got.shape != ref_logits.shape or not np.array_equal(np.isfinite(got), finite):
            return "logits: masked positions differ"
        if not np.allclose(got[finite], ref_logits[finite], atol=1e-4, rtol=1e-5):
            return f"logits off by {np.abs(got[finite] - ref_logits[finite]).max():.3g}"
    elif sc is not None:
        return "scores returned for scores=None"
    return None


@pytest.mark.fuzz
def test_kernel_fuzz_against_float64_reference():
    rng = np.random.default_rng(SEED)
    failures = []
    for i in range(CASES):
        case = draw_case(rng)
        why = mismatch(case)
        if why:
            failures.append(f"case {i}: {case['desc']}: {why}")
    assert not failures, f"{len(failures)} of {CASES} cases mismatch:\n" + "\n".join(failures[:20])
