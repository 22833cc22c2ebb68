"""`_ext.top_rows`, the selection an h2o compaction keeps (caches/h2o/eviction.py), against the rule
written out in NumPy: per row the `count` largest keys, ties to the lower index, NaN as -inf,
ascending, padded with zeros."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_h2o import _ext


def top_rows_reference(key: np.ndarray, count: int, capacity: int) -> np.ndarray:
    ranked = np.where(np.isnan(key), -np.inf, key)
    out = np.zeros((*key.shape[:-1], capacity), np.int32)
    for row in np.ndindex(key.shape[:-1]):
        order = sorted(range(key.shape[-1]), key=lambda j: (-ranked[row][j], j))
        out[row][:count] = np.sort(order[:count])
    return out


def test_top_rows_matches_the_rule_on_random_keys_with_ties_infinities_and_nans():
    rng = np.random.default_rng(21)
    for trial in range(150):
        lead = tuple(int(d) for d in rng.integers(1, 4, size=int(rng.integers(0, 3))))
        P = int(rng.integers(1, 600 if trial % 10 == 0 else 70))
        key = rng.standard_normal((*lead, P)).astype(np.float32)
        if trial % 3 == 0:  # many ties: a few distinct values
            key = rng.integers(-2, 3, (*lead, P)).astype(np.float32)
        special = rng.random((*lead, P))
        key[special < 0.1] = np.inf  # protected entries
        key[(special >= 0.1) & (special < 0.15)] = -np.inf  # dead rows
        if trial % 4 == 1:
            key[(special >= 0.15) & (special < 0.2)] = np.nan
        count = int(rng.integers(1, P + 1))
        capacity = count + int(rng.integers(0, 5)) if trial % 2 else -1
        got = _ext.top_rows(mx.array(key), count, capacity)
        want = top_rows_reference(key, count, count if capacity == -1 else capacity)
        assert got.dtype == mx.int32 and got.shape == want.shape
        np.testing.assert_array_equal(np.array(got), want)


def test_top_rows_under_compile_and_vmap():
    """Inside mx.compile (the eviction plan is compiled) the same indices; vmap takes the composed
    definition (argsort), the same indices where the keys are distinct."""
    rng = np.random.default_rng(22)
    key = mx.array(rng.standard_normal((2, 3, 40)).astype(np.float32))
    want = _ext.top_rows(key, 25, 32)
    assert mx.array_equal(mx.compile(lambda k: _ext.top_rows(k, 25, 32))(key), want)
    mapped = mx.vmap(lambda k: _ext.top_rows(k, 25, 32), in_axes=1, out_axes=1)(key)
    assert mx.array_equal(mapped, want)


@pytest.mark.parametrize(
    "shape, dtype, count, capacity, match",
    [((2, 5), mx.float16, 2, -1, "float32"), ((), mx.float32, 1, -1, "float32 \\(\\.\\.\\., P\\)"),
     ((2, 5), mx.float32, 0, -1, "count must be in \\[1, 5\\]"), ((2, 5), mx.float32, 6, -1, "count must be in \\[1, 5\\]"),
     ((2, 5), mx.float32, 3, 2, "capacity must be at least count")],
)
def test_top_rows_rejects_bad_input(shape, dtype, count, capacity, match):
    with pytest.raises(ValueError, match=match):
        _ext.top_rows(mx.zeros(shape, dtype), count, capacity)
