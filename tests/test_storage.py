"""The storage layer on its own (src/mlx_h2o/storage/), against a dense reference: rows appended in
random chunks, compacted by random gathers, trimmed, saved and loaded must be exactly the
reference rows in the storage's format (dense, packed, tiered), and rotated storage must attend
like the plain rows."""

import copy

import mlx.core as mx
import numpy as np
import pytest

from mlx_h2o import PackedKV, attention_with_scores
from mlx_h2o._native import _ext
from mlx_h2o.storage import CenteredKeysKV, ColumnedKV, KVStore, kv, RotatedKV, SinkRowsKV, TieredKV, make_kv_storage, take_rows

B, H, D = 2, 3, 64
GROUP = 32


def _quantized(x, bits):
    """x as a packed store holds it: (packed, scales, biases) of each row."""
    return list(mx.quantize(x, group_size=GROUP, bits=bits))


def _through(x, bits):
    """x after a trip through `bits`-bit storage (a row demoted from a packed tier)."""
    return x if bits is None else mx.dequantize(*_quantized(x, bits), group_size=GROUP, bits=bits).astype(x.dtype)


def _stored(seg):
    return [seg] if isinstance(seg, mx.array) else list(seg.arrays)


def _expected(rows, bits):
    return [rows] if bits is None else _quantized(rows, bits)


def _assert_segment(seg, rows, bits):
    assert isinstance(seg, PackedKV) == (bits is not None)
    for got, want in zip(_stored(seg), _expected(rows, bits)):
        np.testing.assert_array_equal(np.array(got), np.array(want))


class Reference:
    """Dense rows per (batch, head), kept and compacted with NumPy."""

    def __init__(self):
        self.k = np.zeros((B, H, 0, D), np.float32)
        self.v = np.zeros((B, H, 0, D), np.float32)

    def append(self, k, v):
        self.k = np.concatenate([self.k, np.array(k)], axis=2)
        self.v = np.concatenate([self.v, np.array(v)], axis=2)

    def gather(self, idx):
        take = lambda a: np.take_along_axis(a, np.array(idx)[..., None], axis=2)  # noqa: E731
        self.k, self.v = take(self.k), take(self.v)

    def trim(self, n):
        self.k, self.v = self.k[:, :, : self.k.shape[2] - n], self.v[:, :, : self.v.shape[2] - n]


def _rows(rng, n, dtype=mx.float32):
    return (mx.array(rng.standard_normal((B, H, n, D)).astype(np.float32)).astype(dtype),
            mx.array(rng.standard_normal((B, H, n, D)).astype(np.float32)).astype(dtype))


def _keep_idx(rng, length, keep, protected_tail):
    """Sorted per-(b, h) row indices: `protected_tail` newest rows plus random older ones."""
    out = np.empty((B, H, keep), np.int32)
    for b in range(B):
        for h in range(H):
            old = rng.choice(length - protected_tail, keep - protected_tail, replace=False)
            out[b, h] = np.sort(np.concatenate([old, np.arange(length - protected_tail, length)]))
    return mx.array(out)


def _exercise(store, ref, rng, steps=12, window=0):
    """Appends in random chunks, a gather every few steps (keeping the newest `window` rows
    whole), a trim now and then; the reference follows."""
    for step in range(steps):
        k, v = _rows(rng, int(rng.integers(1, 9)))
        capacity = None if step % 2 else int(rng.integers(0, 80))
        store.append(k, v, capacity)
        ref.append(k, v)
        n = store.length
        if step % 4 == 3 and n > window + 4:
            keep = int(rng.integers(window + 2, n))
            idx = _keep_idx(rng, n, keep, min(window, keep))
            store.gather(idx, keep, min(window, keep), capacity=keep + int(rng.integers(0, 16)))
            ref.gather(idx)
        if step % 5 == 4:
            t = int(rng.integers(0, min(3, store.length) + 1))
            store.trim(t)
            ref.trim(t)
        assert store.length == ref.k.shape[2]


@pytest.mark.parametrize("bits", [None, 8, 4])
def test_kv_store_holds_the_reference_rows(bits):
    rng = np.random.default_rng(bits or 0)
    store, ref = KVStore(bits, GROUP), Reference()
    _exercise(store, ref, rng)
    [(k, v)] = store.segments()
    _assert_segment(k, mx.array(ref.k), bits)
    _assert_segment(v, mx.array(ref.v), bits)
    # State round trip: a new store loaded from the state holds the same rows and keeps working.
    loaded = KVStore(bits, GROUP)
    loaded.load(store.state())
    assert loaded.length == store.length and loaded.nbytes() == store.nbytes()
    more = _rows(rng, 3)
    for s in (store, loaded):
        s.append(*more)
    for (a, _), (b, _) in zip(store.segments(), loaded.segments()):
        for x, y in zip(_stored(a), _stored(b)):
            assert mx.array_equal(x, y)


def test_dense_store_fetch_gives_arrays_and_nbytes_counts_live_rows():
    rng = np.random.default_rng(1)
    store = KVStore(None)
    k, v = _rows(rng, 5, mx.float16)
    store.append(k, v, capacity=64)
    keys, values = store.fetch()
    assert mx.array_equal(keys, k) and mx.array_equal(values, v)
    assert store.nbytes() == 2 * B * H * 5 * D * 2
    packed = KVStore(4, GROUP)
    packed.append(k, v)
    segments, none = packed.fetch()
    assert none is None and isinstance(segments[0][0], PackedKV)


def test_an_append_in_place_writes_only_dense_rows_of_its_own_into_room():
    """`append_in_place` is `append` where it only writes: dense rows of its own with room in the
    buffers, fetched as `fetch` gives them. Anything else (growth, packed rows, a shared prefix,
    columns without room or not yet made) it leaves to `append`, changing nothing."""
    rng = np.random.default_rng(2)
    k, v = _rows(rng, 5, mx.float16)
    one_k, one_v = _rows(rng, 1, mx.float16)
    store, twin = KVStore(None), KVStore(None)
    for s in (store, twin):
        s.append(k, v, capacity=7)
    fetched = store.append_in_place(one_k, one_v)
    twin.append(one_k, one_v)
    assert fetched is not None and store.length == 6
    for got, want in zip(fetched + store.read_rows(), twin.fetch() + twin.read_rows()):
        assert mx.array_equal(got, want)
    assert fetched[0] is store.fetch()[0]  # what attention then recognises as handed on (attended)
    assert store.append_in_place(*_rows(rng, 2, mx.float16)) is None and store.length == 6  # no room for 2
    packed = KVStore(4, GROUP)
    packed.append(k, v, capacity=64)
    assert packed.append_in_place(one_k, one_v) is None and packed.length == 5
    shared = copy.deepcopy(store)  # its rows now a prefix it shares
    assert shared.append_in_place(one_k, one_v) is None and shared.length == 6

    columns = {"acc": "float32", "pos": "int32"}
    assert ColumnedKV(KVStore(None), columns).append_in_place(one_k, one_v, acc=0.0, pos=range(1)) is None  # nothing held yet
    columned, reference = ColumnedKV(KVStore(None), columns), ColumnedKV(KVStore(None), columns)
    for s in (columned, reference):
        s.append(k, v, 8, acc=1.0, pos=range(5))
    for step in range(5):
        new = dict(acc=0.0, pos=range(5 + step, 6 + step))
        written = columned.append_in_place(one_k, one_v, **new)
        assert (written is None) == (step == 3), step  # the 8 rows full after 3; then grown to 16
        if written is None:
            columned.append(one_k, one_v, 16, **new)
        reference.append(one_k, one_v, 16, **new)
    for name in columns:
        assert mx.array_equal(columned.column(name), reference.column(name))
    for got, want in zip(columned.read_rows(), reference.read_rows()):
        assert mx.array_equal(got, want)
    with pytest.raises(ValueError, match="needs the columns"):
        ColumnedKV(KVStore(None), columns).append(k, v, acc=0.0)
    with pytest.raises(ValueError, match="2 values for 1 entries"):
        reference.append_in_place(one_k, one_v, acc=0.0, pos=range(2))


def _assert_rows(store, ref, bits):
    """The store's segments, in order, are the reference rows in its format."""
    start = 0
    for k, v in store.segments():
        n = k.shape[2] if isinstance(k, mx.array) else k.length
        _assert_segment(k, mx.array(ref.k[:, :, start : start + n]), bits)
        _assert_segment(v, mx.array(ref.v[:, :, start : start + n]), bits)
        start += n
    assert start == store.length == ref.k.shape[2]


def _same_state(a, b):
    for x, y in zip(a.state()["k"] + a.state()["v"], b.state()["k"] + b.state()["v"]):
        assert mx.array_equal(x, y)


@pytest.mark.parametrize("bits", [None, 8])
def test_copies_share_their_rows_until_they_rewrite_them(bits):
    """copy.deepcopy shares the rows held (no bytes copied); the original and each copy append after
    them on their own, and copy them only to rewrite them (a gather, a trim into them). Each store
    holds exactly what an independent copy (loaded from the state) holds after the same calls."""
    rng = np.random.default_rng(11)
    store, ref = KVStore(bits, GROUP), Reference()
    for _ in range(3):  # ~1,800 rows: megabytes, well above the allocator's noise
        k, v = _rows(rng, 600)
        store.append(k, v)
        ref.append(k, v)
    prefix = store.nbytes()
    new_rows = [_rows(rng, 3) for _ in range(4)]
    independent = []
    for k, v in new_rows:
        plain = KVStore(bits, GROUP)
        plain.load(store.state())
        plain.append(k, v)
        independent.append(plain)
    mx.eval([x.state() for x in independent])
    before = mx.get_active_memory()
    twins, refs = [store] + [copy.deepcopy(store) for _ in range(3)], [ref] + [copy.deepcopy(ref) for _ in range(3)]
    for twin, r, (k, v) in zip(twins, refs, new_rows):
        twin.append(k, v)
        r.append(k, v)
    mx.eval([seg for twin in twins for seg in twin.segments()])
    # Four stores past the shared rows, each with its 3 new rows in a buffer of its own: less than
    # one more copy of the prefix (copies would take three).
    assert mx.get_active_memory() - before < prefix
    assert all(twin.nbytes() == plain.nbytes() for twin, plain in zip(twins, independent))
    for i, (twin, plain, r) in enumerate(zip(twins, independent, refs)):
        if bits is None:
            _assert_rows(twin, r, bits)
        _same_state(twin, plain)
        _exercise(twin, copy.deepcopy(r), np.random.default_rng(i), steps=8)  # gathers and trims copy the prefix first
        _exercise(plain, r, np.random.default_rng(i), steps=8)
        _same_state(twin, plain)
        if bits is None:
            _assert_rows(twin, r, bits)


def test_a_store_copied_turn_after_turn_reads_a_bounded_number_of_segments():
    rng = np.random.default_rng(12)
    store, ref = KVStore(None), Reference()
    for _ in range(12):  # a chat's snapshots: a copy at the end of every turn
        k, v = _rows(rng, 5)
        store.append(k, v)
        ref.append(k, v)
        store = copy.deepcopy(store)
    assert len(store.segments()) <= kv.MAX_SHARED_PIECES + 1
    _assert_rows(store, ref, None)


def test_tiers_copied_turn_after_turn_fetch_what_the_fused_op_takes():
    """Two tiers, each shared in pieces: fetch gives at most the op's segment limit, the rows of a
    storage never copied."""
    rng = np.random.default_rng(13)
    store, plain = TieredKV(4, None, 6, GROUP), TieredKV(4, None, 6, GROUP)
    for _ in range(4):
        k, v = _rows(rng, 9)
        store.append(k, v)
        plain.append(k, v)
        store = copy.deepcopy(store)
    segments, _ = store.fetch()
    assert len(segments) <= kv.MAX_SEGMENTS
    for tier in ("low", "high"):
        _same_state(getattr(store, tier), getattr(plain, tier))


@pytest.mark.parametrize("low, high", [(4, 8), (8, None), (4, None), (8, 4)])
def test_tiered_storage_demotes_rows_leaving_the_window(low, high):
    """Rows older than the window are in the low tier's format, converted once from the high
    tier's; the newest `window` rows stay in the high tier through appends, gathers and trims."""
    rng = np.random.default_rng(7)
    window = 6
    store, ref = TieredKV(low, high, window, GROUP), Reference()
    _exercise(store, ref, rng, steps=16, window=window)
    n = store.length
    n_high = min(window, n) if n else 0
    segments = store.segments()
    tiers = [(low, 0, n - n_high), (high, n - n_high, n)]
    tiers = [t for t in tiers if t[2] > t[1]]
    assert len(segments) == len(tiers)
    for (k, v), (bits, a, b) in zip(segments, tiers):
        for seg, rows in ((k, ref.k), (v, ref.v)):
            want = mx.array(rows[:, :, a:b])
            if bits == low and low != high:
                want = _through(want, high)  # demoted rows went through the high tier's format
            _assert_segment(seg, want, bits)
    loaded = TieredKV(low, high, window, GROUP)
    loaded.load(store.state())
    assert loaded.length == n and loaded.nbytes() == store.nbytes()


def test_tiered_storage_reads_rows_before_any_left_the_window():
    """Content-aware eviction reads every row densely; while the window holds them all, the low tier
    is empty and the rows are the high tier's."""
    store = TieredKV(4, None, 6, GROUP)
    k = mx.random.normal((1, 2, 3, GROUP), key=mx.random.key(1))
    store.append(k, -k)
    keys, values = store.read_rows()
    assert store.low.length == 0
    np.testing.assert_array_equal(np.array(keys), np.array(k))
    np.testing.assert_array_equal(np.array(values), -np.array(k))


def test_make_kv_storage_picks_one_format_when_tiers_agree():
    assert isinstance(make_kv_storage(8, 8, 16), KVStore)
    assert isinstance(make_kv_storage(4, 8, 16), TieredKV)


@pytest.mark.parametrize("lam", ["none", "prefill"])
def test_rotated_storage_attends_like_the_plain_rows(lam):
    """Rows stored rotated (and λ-scaled), queries rotated in, output rotated back: the same
    attention as over the plain rows (dense inner storage: no quantization error)."""
    rng = np.random.default_rng(3)
    store, plain = RotatedKV(KVStore(None), seed=5, lam=lam), KVStore(None)
    for n in (7, 1, 4):
        k, v = _rows(rng, n)
        store.append(k, v)
        plain.append(k, v)
    q = mx.array(rng.standard_normal((B, 2 * H, 3, D)).astype(np.float32))
    want, _ = attention_with_scores(q, plain.segments(), scale=D**-0.5, mask="causal", scores=None)
    out, _ = attention_with_scores(store.prepare_queries(q), store.segments(), scale=D**-0.5, mask="causal", scores=None)
    got = store.restore_output(out, q.dtype)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-5, rtol=1e-4)
    loaded = RotatedKV(KVStore(None), seed=5, lam=lam)
    loaded.load(store.state())
    out2, _ = attention_with_scores(loaded.prepare_queries(q), loaded.segments(), scale=D**-0.5, mask="causal", scores=None)
    assert mx.array_equal(loaded.restore_output(out2, q.dtype), got)


def take_rows_reference(a: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Rows idx of a per (batch, head); an index outside [0, C) gives zeros."""
    valid = (idx >= 0) & (idx < a.shape[2])
    expanded = (*idx.shape, *(1,) * (a.ndim - 3))
    if a.shape[2] == 0:
        return np.zeros((*idx.shape, *a.shape[3:]), a.dtype)
    rows = np.take_along_axis(a, np.where(valid, idx, 0).reshape(expanded), axis=2)
    return np.where(valid.reshape(expanded), rows, 0)


def test_take_rows_matches_numpy_on_random_shapes_and_dtypes():
    rng = np.random.default_rng(9)
    dtypes = [np.float32, np.float16, np.uint32, np.int32, np.uint8]
    for trial in range(200):
        Bt, Ht, K = (int(rng.integers(1, 4)), int(rng.integers(1, 4)), int(rng.integers(0, 40)))
        arrays = []
        for _ in range(int(rng.integers(1, 5))):  # each its own capacity, dtype and trailing shape
            C, dtype = int(rng.integers(0 if trial % 7 == 3 else 1, 30)), dtypes[int(rng.integers(len(dtypes)))]  # (C = 0: all zeros)
            shape = (Bt, Ht, C, *(int(d) for d in rng.integers(1, 6, size=int(rng.integers(0, 3)))))
            x = rng.standard_normal(shape) * 100 if np.dtype(dtype).kind == "f" else rng.integers(0, 200, shape)
            arrays.append(x.astype(dtype))
        C_min = min(a.shape[2] for a in arrays)
        idx = rng.integers(0 if trial % 2 and C_min else -3, C_min if trial % 2 and C_min else C_min + 3, (Bt, Ht, K))
        idx_dtype = np.uint32 if trial % 4 == 1 else np.int32
        inputs = [mx.array(a) for a in arrays]
        if trial % 5 == 0:  # a transposed view: read as it is
            inputs[0] = mx.array(np.ascontiguousarray(np.swapaxes(arrays[0], 0, 2))).swapaxes(0, 2)
        got = take_rows(inputs, mx.array(idx.astype(idx_dtype)))
        assert len(got) == len(arrays)
        for a, g in zip(arrays, got):
            assert g.dtype == mx.array(a).dtype
            np.testing.assert_array_equal(np.array(g), take_rows_reference(a, idx.astype(idx_dtype).astype(np.int64)))
    # the definition the primitive takes its derivatives from: the same rows
    a, idx = mx.array(rng.standard_normal((2, 3, 7, 4)).astype(np.float32)), mx.array(rng.integers(-1, 8, (2, 3, 5)).astype(np.int32))
    weights = mx.array(rng.standard_normal((2, 3, 5, 4)).astype(np.float32))
    grad = mx.grad(lambda x: (_ext.take_rows([x], idx)[0] * weights).sum())(a)
    expected = np.zeros((2, 3, 7, 4), np.float32)
    for b, h, k in np.ndindex(2, 3, 5):
        r = int(np.array(idx)[b, h, k])
        if 0 <= r < 7:
            expected[b, h, r] += np.array(weights)[b, h, k]
    np.testing.assert_allclose(np.array(grad), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "shapes, idx_shape, idx_dtype, match",
    [([], (1, 2, 3), mx.int32, "at least one array"), ([(1, 2, 5, 4)], (1, 2), mx.int32, "idx must be"),
     ([(1, 2, 5, 4)], (1, 2, 3), mx.float32, "idx must be"), ([(1, 3, 5, 4)], (1, 2, 3), mx.int32, "idx's \\(B, H\\)"),
     ([(1, 2)], (1, 2, 3), mx.int32, "idx's \\(B, H\\)")],
)
def test_take_rows_rejects_bad_input(shapes, idx_shape, idx_dtype, match):
    with pytest.raises(ValueError, match=match):
        _ext.take_rows([mx.zeros(s) for s in shapes], mx.zeros(idx_shape, idx_dtype))


def test_centred_keys_attend_like_the_plain_rows():
    """Keys stored less their mean (fixed when the rows first pass `after`, the sink rows left out,
    the rows held then written again centred): the same attention and the same rows read back as
    the plain rows, rotated or not (dense tiers: no rounding), before and after the centre is
    fixed, and after a state round trip."""
    rng = np.random.default_rng(11)
    after, skip = 6, 1
    for rotated in (False, True):
        wrap = (lambda s: RotatedKV(s, seed=5)) if rotated else (lambda s: s)
        store = wrap(CenteredKeysKV(TieredKV(None, None, 4, GROUP), after, skip))
        plain = wrap(TieredKV(None, None, 4, GROUP))
        centred = store.inner if rotated else store
        chunks = []
        for n in (3, 2, 5, 1, 4):
            k, v = _rows(rng, n)
            chunks.append(k)
            store.append(k, v)
            plain.append(k, v)
            assert (centred.center is None) == (store.length <= after)
            q = mx.array(rng.standard_normal((B, 2 * H, 2, D)).astype(np.float32))
            want, _ = attention_with_scores(plain.prepare_queries(q), plain.segments(), scale=D**-0.5, mask="causal", scores=None)
            out, _ = attention_with_scores(store.prepare_queries(q), store.segments(), scale=D**-0.5, mask="causal", scores=None)
            np.testing.assert_allclose(np.array(store.restore_output(out, q.dtype)), np.array(plain.restore_output(want, q.dtype)),
                                       atol=2e-5, rtol=1e-4)
            for got, ref in zip(store.read_rows(), plain.read_rows()):
                np.testing.assert_allclose(np.array(got), np.array(ref), atol=2e-5)
        keys = np.concatenate([np.array(c) for c in chunks], axis=2)
        # fixed by the call that passed `after` rows (3 + 2 + 5), from the rows after the sink
        np.testing.assert_allclose(np.array(centred.center), keys[:, :, skip:10].mean(axis=2, keepdims=True), atol=1e-5)
        assert store.nbytes() == plain.nbytes() + 2 * B * H * D * 4  # the centre is counted (model and stored space)
        loaded = wrap(CenteredKeysKV(TieredKV(None, None, 4, GROUP), after, skip))
        loaded.load(store.state())
        more = _rows(rng, 2)
        for s in (store, loaded):
            s.append(*more)
        for a, b in zip(store.read_rows(), loaded.read_rows()):
            assert mx.array_equal(a, b)


def test_sink_rows_keep_their_format_through_gathers_and_trims():
    """The first `count` rows in their own format (8-bit) before a tiered storage's rows: gathers
    that keep them (as a cache's protected sinks) and trims leave them in place."""
    rng = np.random.default_rng(12)
    count, window = 2, 4
    store, ref = SinkRowsKV(TieredKV(4, None, window, GROUP), count, 8, GROUP), Reference()
    for step in range(10):
        k, v = _rows(rng, int(rng.integers(1, 6)))
        store.append(k, v, None if step % 2 else 40)
        ref.append(k, v)
        n = store.length
        if step % 3 == 2 and n > count + window + 2:
            keep = int(rng.integers(count + window + 1, n))
            rest = _keep_idx(rng, n - count, keep - count, window)
            idx = mx.concatenate([mx.broadcast_to(mx.arange(count, dtype=mx.int32), (B, H, count)), rest + count], axis=2)
            store.gather(idx, keep, window, capacity=keep + 3)
            ref.gather(idx)
        if step == 7:
            store.trim(2)
            ref.trim(2)
        assert store.length == ref.k.shape[2]
    (sk, sv), *rest = store.segments()
    _assert_segment(sk, mx.array(ref.k[:, :, :count]), 8)
    _assert_segment(sv, mx.array(ref.v[:, :, :count]), 8)
    keys, values = store.read_rows()
    np.testing.assert_allclose(np.array(keys)[:, :, :count], _through(mx.array(ref.k[:, :, :count]), 8), atol=1e-6)
    np.testing.assert_allclose(np.array(keys)[:, :, -window:], ref.k[:, :, -window:], atol=1e-6)  # the dense window
    assert np.abs(np.array(values) - ref.v).max() < 0.5  # the older rows at 4 bits
    loaded = SinkRowsKV(TieredKV(4, None, window, GROUP), count, 8, GROUP)
    loaded.load(store.state())
    assert loaded.length == store.length and loaded.nbytes() == store.nbytes()
    with pytest.raises(ValueError, match="cannot be rewritten"):
        store.write_rows(mx.zeros((B, H, 1), mx.int32), keys[:, :, :1], values[:, :, :1])
