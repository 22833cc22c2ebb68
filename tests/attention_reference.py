"""Shared by the attention tests: a float64 NumPy reference and a checker for all three score modes."""

import contextlib

import mlx.core as mx
import numpy as np

import mlx_h2o

sdpa = mlx_h2o.scaled_dot_product_attention_with_scores

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
# Output tolerance per dtype: the kernel accumulates in float32 and rounds once to the output dtype.
OUT_TOL = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1.6e-2}
HEADS = [(1, 1), (4, 1), (9, 3), (8, 8)]
LENGTHS = [1, 2, 7, 33]
SIZES = [1, 5, 64, 1000, 4099]
HEAD_DIMS = [64, 80, 96, 128, 256]


def _f64(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32), dtype=np.float64)


LOG2E = np.float32(1.4426950408889634)


def int8_queries(q, scale):
    """q as the kernel dots it with packed 4-/8-bit keys, times scale (natural-unit logits = this . k):
    q * (scale * log2 e) in float32, rounded to int8 per 32 values (scale max|.| / 127, round to
    nearest even), times ln 2 — the kernel's own arithmetic, so only float64 rounding remains."""
    c = np.float32(np.float32(scale) * LOG2E)
    qs = (np.array(q.astype(mx.float32), dtype=np.float32) * c).astype(np.float32)
    blocks = qs.reshape(*qs.shape[:-1], qs.shape[-1] // 32, 32)
    m = np.abs(blocks).max(-1, keepdims=True)
    inv = (np.float32(127) / np.where(m > 0, m, np.float32(1))).astype(np.float32) * (m > 0)
    xq = np.rint(blocks.astype(np.float64) * inv.astype(np.float64))
    d = (m / np.float32(127)).astype(np.float32).astype(np.float64)
    return (xq * d).reshape(qs.shape) * np.log(2.0)


def reference(q, k, v, scale, mask=None, sinks=None, int8_keys=None):
    """float64 attention from the (already rounded) inputs: (out, mass, logits). int8_keys: (N,) bool,
    the key positions the kernel dots with int8-rounded queries (packed 4-/8-bit keys)."""
    q8 = int8_queries(q, scale) if int8_keys is not None and np.any(int8_keys) else None
    q, k, v = _f64(q), _f64(k), _f64(v)
    B, Hq, L, _ = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G = Hq // Hkv
    logits = np.einsum("bhgld,bhnd->bhgln", q.reshape(B, Hkv, G, L, -1), k).reshape(B, Hq, L, N) * scale
    if q8 is not None:
        logits8 = np.einsum("bhgld,bhnd->bhgln", q8.reshape(B, Hkv, G, L, -1), k).reshape(B, Hq, L, N)
        logits = np.where(np.asarray(int8_keys, bool), logits8, logits)
    if isinstance(mask, str):
        logits = np.where(np.arange(N - L, N)[:, None] >= np.arange(N)[None], logits, -np.inf)
    elif mask is not None:
        m = np.broadcast_to(np.array(mask) if mask.dtype == mx.bool_ else _f64(mask), (B, Hq, L, N))
        logits = np.where(m, logits, -np.inf) if mask.dtype == mx.bool_ else logits + m
    top = logits.max(-1, keepdims=True)
    if sinks is not None:
        s = _f64(sinks)[None, :, None, None]
        top = np.maximum(top, s)
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.exp(logits - top)
        den = e.sum(-1, keepdims=True) + (np.exp(s - top) if sinks is not None else 0.0)
        p = np.where(np.isfinite(top) & (den > 0), e / den, 0.0)
    out = np.einsum("bhgln,bhnd->bhgld", p.reshape(B, Hkv, G, L, N), v).reshape(B, Hq, L, -1)
    mass = p.reshape(B, Hkv, G, L, N).sum(axis=(2, 3))
    return out, mass, logits


def randn(rng, shape, dtype, scale=1.0):
    return mx.array((scale * rng.standard_normal(shape)).astype(np.float32)).astype(dtype)


def make_inputs(rng, B, Hq, Hkv, L, N, D, dtype, Dv=None):
    q = randn(rng, (B, Hq, L, D), dtype)
    k = randn(rng, (B, Hkv, N, D), dtype)
    v = randn(rng, (B, Hkv, N, Dv or D), dtype)
    return q, k, v


def random_mask(rng, kind, B, Hq, L, N):
    if kind == "bool":
        m = rng.random((B, 1, L, N)) < 0.8  # broadcast over heads
        m[..., 0] = True  # keep every row attending to something (fully masked rows tested apart)
        return mx.array(m)
    if kind == "additive":
        return mx.array(rng.standard_normal((L, N)).astype(np.float32))  # broadcast over B and heads
    if kind == "additive-f16":
        return mx.array(rng.standard_normal((1, Hq, L, N)).astype(np.float16))
    return kind  # None or "causal"


def check(q, k, v, scale, mask=None, sinks=None, fn=sdpa, ref_kv=None, int8_keys=None):
    """Runs `fn(q, k, v, ...)` in every score mode against the float64 reference (computed from
    `ref_kv` = (k, v) as float arrays when k, v are not plain arrays, with int8 queries at `int8_keys`);
    returns the mass."""
    name = {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16"}[q.dtype]
    ref_out, ref_mass, ref_logits = reference(q, *(ref_kv or (k, v)), scale, mask, sinks, int8_keys)
    out, mass = fn(q, k, v, scale=scale, mask=mask, sinks=sinks, scores="mass")
    assert out.dtype == q.dtype and out.shape == ref_out.shape
    np.testing.assert_allclose(_f64(out), ref_out, atol=OUT_TOL[name], rtol=OUT_TOL[name])
    assert mass.dtype == mx.float32 and mass.shape == ref_mass.shape
    np.testing.assert_allclose(np.array(mass), ref_mass, atol=2e-5 * max(1, q.shape[2]), rtol=1e-4)
    out2, logits = fn(q, k, v, scale=scale, mask=mask, sinks=sinks, scores="logits")
    np.testing.assert_array_equal(_f64(out2), _f64(out))
    logits = np.array(logits)
    finite = np.isfinite(ref_logits)
    np.testing.assert_array_equal(np.isfinite(logits), finite)
    np.testing.assert_allclose(logits[finite], ref_logits[finite], atol=1e-4, rtol=1e-5)
    out3, none = fn(q, k, v, scale=scale, mask=mask, sinks=sinks, scores=None)
    assert none is None
    np.testing.assert_array_equal(_f64(out3), _f64(out))
    return np.array(mass)


@contextlib.contextmanager
def float_queries():
    """Attention ops built inside use float32 queries for packed keys too (no int8 Q K^T): for
    comparisons with another engine's dequantize-then-attend path on the same packed K/V."""
    mlx_h2o._ext.set_attention_int8_queries(False)
    try:
        yield
    finally:
        mlx_h2o._ext.set_attention_int8_queries(True)
