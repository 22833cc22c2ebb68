"""Rotate-then-quantize: the rotation is orthogonal for every head dim, rotated attention equals plain
attention on unquantized data, error falls with bits, save/load reproduces, options are validated."""

import mlx.core as mx
import numpy as np
import pytest
from decoding import step_logits, tokens
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache
from tiny_models import tiny_model

import mlx_h2o
from mlx_h2o import PackedKV
from mlx_h2o.caches.rotated import RotatedQuantizedKVCache, calibrate_lambdas
from mlx_h2o.storage.rotation import KVRotation, orthonormal_basis


@pytest.mark.parametrize("dim", [64, 80, 96, 128, 256, 72, 5, 1])
def test_rotation_is_orthogonal(dim):
    b = orthonormal_basis(dim)
    np.testing.assert_allclose(b @ b.T, np.eye(dim), atol=1e-12)
    rot = KVRotation.seeded(dim, dim, seed=3)
    x = mx.array(np.random.default_rng(0).standard_normal((2, 3, 7, dim)).astype(np.float32))
    y = rot.keys(x)
    np.testing.assert_allclose(np.linalg.norm(np.array(y), axis=-1), np.linalg.norm(np.array(x), axis=-1), rtol=1e-5)
    gram_x = np.einsum("bhnd,bhmd->bhnm", np.array(x), np.array(x))
    gram_y = np.einsum("bhnd,bhmd->bhnm", np.array(y), np.array(y))
    np.testing.assert_allclose(gram_y, gram_x, atol=1e-4 * dim)
    if dim > 1:
        assert not np.allclose(np.array(y), np.array(x))  # it does rotate


def _kv(rng, B=1, H=2, N=200, D=64, outlier=True):
    x = rng.standard_normal((B, H, N, D)).astype(np.float32)
    if outlier:
        x[..., 3] *= 25.0  # one dominant channel, as real keys have
    return mx.array(x)


def _roundtrip_error(bits, rotate, outlier=True):
    rng = np.random.default_rng(1)
    x = _kv(rng, outlier=outlier)
    rot = KVRotation.seeded(64, 64, seed=0) if rotate else None
    y = rot.keys(x) if rotate else x
    back = mx.dequantize(*mx.quantize(y, group_size=32, bits=bits), group_size=32, bits=bits)
    if rotate:
        back = back @ rot.rk
    return float(mx.sqrt(mx.mean((back - x) ** 2)) / mx.sqrt(mx.mean(x**2)))


def test_roundtrip_error_falls_with_bits_and_rotation_helps_outliers():
    errs = [_roundtrip_error(b, rotate=True) for b in (2, 3, 4, 8)]
    assert all(a > b for a, b in zip(errs, errs[1:])), errs
    assert errs[-1] < 0.01
    assert _roundtrip_error(4, rotate=True) < 0.7 * _roundtrip_error(4, rotate=False)


def _attend_all(model, cache, x):
    """Every position's logits: a prefill of 12 tokens, then one token at a time."""
    return step_logits(model, x, cache, prefill=12, every_position=True)


def _tiers(cache):
    """(packed rows, full-precision window rows) of a rotated cache, read off its segments."""
    segments = cache.store.segments()
    packed = sum(k.length for k, _ in segments if isinstance(k, PackedKV))
    window = sum(k.shape[2] for k, _ in segments if not isinstance(k, PackedKV))
    return packed, window


@pytest.mark.parametrize("lam", ["none", "prefill"])
def test_rotated_attention_equals_plain_attention_without_quantization(lam):
    """With a window as long as the sequence nothing is packed: only the rotation (and λ) act, and
    the logits must equal the full cache's."""
    model = tiny_model("llama", head_dim=64, hidden_size=128)
    x = tokens(40, seed=2, batch=1, vocab=101)
    full = _attend_all(model, mlx_h2o.make_cache(model, "full"), x)
    cache = mlx_h2o.make_cache(model, "rotated", bits=4, residual=1000, lam=lam)
    rotated = _attend_all(model, cache, x)
    np.testing.assert_allclose(rotated, full, atol=2e-4, rtol=1e-4)
    assert all(_tiers(c) == (0, 40) for c in cache)


def test_packed_and_window_segments_and_bits():
    model = tiny_model("qwen3", head_dim=64, hidden_size=128)
    x = tokens(60, seed=3, batch=1, vocab=101)
    full = _attend_all(model, mlx_h2o.make_cache(model, "full"), x)
    errs = {}
    for bits in (2, 4, 8):
        cache = mlx_h2o.make_cache(model, "rotated", bits=bits, residual=16)
        errs[bits] = np.abs(_attend_all(model, cache, x) - full).max()
        assert all(_tiers(c) == (44, 16) and c.offset == 60 for c in cache)
    assert errs[8] < errs[4] < errs[2], errs
    assert errs[8] < 0.1 * errs[2], errs


def test_nbytes_is_packed_plus_window():
    model = tiny_model("llama", head_dim=64, hidden_size=128)
    cache = mlx_h2o.make_cache(model, "rotated", bits=4, group_size=64, residual=8)
    _attend_all(model, cache, mx.arange(30)[None])
    packed_row = 2 * (64 * 4 // 8 + 2 * 4)  # 2 kv heads: nibbles + f32 scale and bias per group of 64
    window_row = 2 * 64 * 4  # float32 activations
    assert all(c.nbytes == 2 * (22 * packed_row + 8 * window_row) for c in cache)


def test_save_load_reproduces_generation(tmp_path):
    model = tiny_model("llama", head_dim=64, hidden_size=128)
    x = tokens(40, seed=4, batch=1, vocab=101)
    cache = mlx_h2o.make_cache(model, "rotated", bits=3, residual=8, seed=5)
    _attend_all(model, cache, x)
    save_prompt_cache(str(tmp_path / "r.safetensors"), cache)
    loaded = load_prompt_cache(str(tmp_path / "r.safetensors"))
    assert all(type(c) is RotatedQuantizedKVCache for c in loaded)
    for step in ([7], [9], [11]):  # several steps: new rows get packed with the restored rotation
        nxt = mx.array([step])
        np.testing.assert_array_equal(np.array(model(nxt, cache=cache)), np.array(model(nxt, cache=loaded)))


def test_trim():
    """One layer, so K/V depend on the tokens alone: trimming 20 of 50 tokens (8 from the window,
    12 packed rows) must leave exactly the cache that packs the first 30 tokens."""
    model = tiny_model("llama", head_dim=64, hidden_size=128, num_hidden_layers=1)
    x = tokens(50, seed=5, batch=1, vocab=101)
    a = mlx_h2o.make_cache(model, "rotated", residual=8)
    _attend_all(model, a, x)
    b = mlx_h2o.make_cache(model, "rotated", residual=0)
    _attend_all(model, b, x[:, :30])
    assert a[0].trim(20) == 20 and a[0].offset == 30 and _tiers(a[0]) == (30, 0)
    [(mine_k, mine_v)], [(ref_k, ref_v)] = a[0].store.segments(), b[0].store.segments()
    for mine, ref in ((mine_k, ref_k), (mine_v, ref_v)):
        for x, y in zip(mine.arrays, ref.arrays):
            assert mx.array_equal(x, y)


def test_calibrated_lambdas():
    model = tiny_model("llama", head_dim=64, hidden_size=128)
    calib = calibrate_lambdas(model, list(range(50)))
    assert len(calib) == 2 and calib[0][0].shape == (2, 64)
    cache = mlx_h2o.make_cache(model, "rotated", lam=calib)
    _attend_all(model, cache, mx.arange(20)[None])
    assert mx.array_equal(cache[0].lambdas[0], calib[0][0])


def test_bad_options():
    model = tiny_model("llama", head_dim=64, hidden_size=128)
    for kwargs, match in [
        (dict(bits=5), "bits must be one of"),
        (dict(group_size=48), "group_size must be one of"),
        (dict(residual=-1), "residual must be"),
        (dict(lam="learned"), "lam must be one of"),
        (dict(max_kv_size=3), "unknown option\\(s\\) max_kv_size for policy 'rotated'"),
    ]:
        with pytest.raises(ValueError, match=match):
            mlx_h2o.make_cache(model, "rotated", **kwargs)
