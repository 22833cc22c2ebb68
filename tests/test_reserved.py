"""The reserved KV cache and its storage: contents equal mlx-lm's KVCache after any sequence of
updates and trims, writes happen in place, untouched pages stay uncommitted, trim gives pages
back, and bad sizes / overflows are clear ValueErrors."""

import os
import sys

import mlx_h2o  # noqa: F401  isort: skip

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models import cache as lm_cache
from mlx_lm.models import llama

from mlx_h2o import _ext, make_cache
from mlx_h2o.storage import ReservedBuffer
from mlx_h2o.caches.reserved import ReservedKVCache
from mlx_h2o.evaluation.memory import _current_rss_bytes, array_address, memory_maps, resident_bytes

PAGE = _ext.page_size()
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="page release and mincore are Linux-only")


def _resident_pages(a: mx.array) -> int:
    return resident_bytes(a) // PAGE


def _np(a):
    return np.array(a.astype(mx.float32)) if a is not None else None


def _tiny_model(seed=0):
    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=97, max_position_embeddings=256,
    )
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


# --- storage and the C++ ops -------------------------------------------------------------------


@linux_only
def test_reservation_commits_no_pages_even_when_the_allocator_recycles():
    n = 24 << 20  # under MLX's 32 MB buffer cache, so a freed buffer of this size is reused dirty
    dirty = mx.ones([n], mx.uint8)
    mx.eval(dirty)
    del dirty
    a = _ext.uninitialized([n], mx.uint8)
    assert array_address(a) % PAGE == 0
    assert _resident_pages(a) == 0
    a[: 10 * PAGE + 1] = mx.ones([10 * PAGE + 1], mx.uint8)
    mx.eval(a)
    assert _resident_pages(a) == 11  # exactly the pages the written bytes span


@linux_only
def test_untouched_reservation_does_not_grow_rss():
    # RSS is process-wide (other threads allocate too), so the check leaves generous slack: a
    # committed reservation would add 256 MiB, an uncommitted one adds next to nothing.
    mx.eval(mx.zeros([1]))
    before = _current_rss_bytes()
    a = _ext.uninitialized([1 << 26], mx.float32)  # 256 MiB
    mx.eval(a)
    grew = _current_rss_bytes() - before
    assert grew < 32 << 20, f"an untouched 256 MiB reservation grew RSS by {grew / 2**20:.1f} MiB"
    a[: 1 << 24] = mx.ones([1 << 24], mx.float32)  # write 64 MiB of it
    mx.eval(a)
    # What the write committed, counted on the buffer itself (mincore): the process's RSS also moves
    # with whatever MLX's allocator frees meanwhile.
    assert resident_bytes(a) == 64 << 20, resident_bytes(a) / 2**20


@pytest.mark.parametrize("dtype", [mx.bool_, mx.uint8, mx.float16, mx.bfloat16, mx.float32, mx.int64, mx.complex64])
def test_uninitialized_shapes_and_dtypes(dtype):
    for shape in ([0], [3], [2, 0, 5], [PAGE + 3], [2, 3, 700, 16]):
        a = _ext.uninitialized(shape, dtype)
        assert a.shape == tuple(shape) and a.dtype == dtype
        if a.nbytes >= PAGE and dtype != mx.bfloat16:  # (NumPy cannot view bfloat16)
            assert array_address(a) % PAGE == 0
        x = mx.random.uniform(shape=shape) > 0.5 if dtype == mx.bool_ else (mx.random.normal(shape) * 10).astype(dtype)
        a[...] = x
        assert mx.array_equal(a, x).item()


def test_bad_reservations_and_releases_are_clear_errors():
    with pytest.raises(ValueError, match="non-negative"):
        _ext.uninitialized([4, -1], mx.float32)
    with pytest.raises(ValueError, match="overflows"):
        _ext.uninitialized([2**31 - 1] * 3, mx.float32)
    a = _ext.uninitialized([2, 3, 8, 4], mx.float32)
    with pytest.raises(ValueError, match=r"start must be in \[0, 8\]"):
        _ext.release_pages(a, 9)
    with pytest.raises(ValueError, match=r"start must be in \[0, 8\]"):
        _ext.release_pages(a, -1)
    with pytest.raises(ValueError, match=r"axis must be in \[-4, 4\)"):
        _ext.release_pages(a, 0, axis=4)
    with pytest.raises(ValueError, match="row-contiguous"):
        _ext.release_pages(mx.zeros([64, 64]).T, 1, axis=0)
    for capacity in (0, -3, 1.5, True, "8", 2**31, None):
        with pytest.raises(ValueError, match="capacity must be an integer"):
            ReservedBuffer(capacity)
    b = ReservedBuffer(10)
    b.write(0, mx.zeros([1, 2, 4, 8]))
    with pytest.raises(ValueError, match=r"shape \(1, 2, L, 8\)"):
        b.write(b.length, mx.zeros([1, 3, 1, 8]))
    with pytest.raises(ValueError, match=r"start must be an integer in \[0, 4\]"):
        b.write(5, mx.zeros([1, 2, 1, 8]))
    with pytest.raises(ValueError, match=r"past the capacity of 10"):
        b.write(b.length, mx.zeros([1, 2, 7, 8]))
    with pytest.raises(ValueError, match=r"length must be an integer in \[0, 4\]"):
        b.truncate(5)
    assert b.length == 4


@linux_only
def test_release_pages_gives_back_whole_pages_of_dead_positions_only():
    rows = 4 * PAGE // (16 * 4)  # 4 pages of rows
    a = _ext.uninitialized([1, 3, 2 * rows, 16], mx.float32)  # each of the 3 heads spans 8 pages
    x = mx.random.normal([1, 3, rows, 16])
    # A partial slice_update writes into `a` (assigning all of it would replace the buffer).
    a[..., :rows, :] = x
    mx.eval(a)
    assert _resident_pages(a) == 3 * 4
    keep = rows // 4 + 1  # one row into each head's second page
    released = _ext.release_pages(a, keep)
    assert released == 3 * 6 * PAGE  # pages 3..8 of each head; page 2 still holds a live row
    assert _resident_pages(a) == 3 * 2
    assert np.array_equal(np.array(a[..., :keep, :]), np.array(x[..., :keep, :]))  # live rows intact


def test_release_pages_leaves_buffers_others_can_still_read():
    a = _ext.uninitialized([1, 2, 4 * PAGE // 32, 8], mx.float32)
    a[..., 1:, :] = mx.random.normal([1, 2, 4 * PAGE // 32 - 1, 8])
    mx.eval(a)
    expected = np.array(a)
    lazy = a[..., 1:, :] * 1  # a pending reader
    evaluated = a[..., 1:, :]
    mx.eval(evaluated)  # an evaluated view sharing the buffer
    assert _ext.release_pages(a, 0) == 0
    del evaluated
    assert _ext.release_pages(a, 0) == 0
    assert np.array_equal(np.array(lazy), expected[..., 1:, :])
    del lazy
    assert _ext.release_pages(a, 0) == (a.nbytes if sys.platform.startswith("linux") else 0)


# --- the cache ------------------------------------------------------------------------------


def _random_kv(rng, B, H, L, Dk, Dv, dtype):
    k = mx.array(rng.standard_normal((B, H, L, Dk)).astype(np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal((B, H, L, Dv)).astype(np.float32)).astype(dtype)
    return k, v


def _assert_same_as_kvcache(ours, ref, fetched=None):
    assert ours.offset == ref.offset and ours.size() == ref.size()
    if ref.keys is None:
        assert ours.keys is None and ours.nbytes == 0
        return
    if fetched is None:
        fetched = ref.keys[..., : ref.offset, :], ref.values[..., : ref.offset, :]
    for mine, theirs in zip((ours.keys, ours.values), fetched):
        assert mine.dtype == theirs.dtype
        assert np.array_equal(_np(mine), _np(theirs))
    # nbytes counts live tokens only (KVCache's counts its 256-step slack too).
    assert ours.nbytes == sum(x.nbytes for x in fetched)
    for n in (1, 3):
        assert ours.make_mask(n, return_array=False, window_size=None) == ref.make_mask(n, return_array=False, window_size=None)
        mine, theirs = (c.make_mask(n, return_array=True, window_size=None) for c in (ours, ref))
        assert np.array_equal(np.array(mine), np.array(theirs))


@pytest.mark.parametrize("seed", range(12))
def test_random_updates_and_trims_match_kvcache(seed):
    rng = np.random.default_rng(seed)
    B, H = int(rng.integers(1, 3)), int(rng.choice([1, 2, 3]))
    Dk = int(rng.choice([8, 16, 64, 80]))
    Dv = int(rng.choice([Dk, 32]))
    dtype = [mx.float32, mx.float16, mx.bfloat16][seed % 3]
    max_context = int(rng.integers(40, 700))
    ours, ref = ReservedKVCache(max_context), lm_cache.KVCache()
    held = []  # arrays handed out earlier must never change, whatever happens later
    for _ in range(int(rng.integers(20, 60))):
        op = rng.random()
        if op < 0.65:
            room = max_context - ref.offset
            L = int(rng.choice([1, 1, 1, int(rng.integers(1, 40))]))
            if L > room:
                continue
            k, v = _random_kv(rng, B, H, L, Dk, Dv, dtype)
            got = ours.update_and_fetch(k, v)
            want = ref.update_and_fetch(k, v)
            if rng.random() < 0.3:  # keep some, evaluated or still lazy (a pending reader)
                if rng.random() < 0.5:
                    mx.eval(got)
                held.append((got, [_np(w) for w in want]))
            _assert_same_as_kvcache(ours, ref, want)
        elif op < 0.9:
            n = int(rng.integers(0, ref.offset + 5))
            assert ours.trim(n) == ref.trim(n)
            _assert_same_as_kvcache(ours, ref)
        else:
            ours.reset()
            ref.trim(ref.offset)
            _assert_same_as_kvcache(ours, ref)
    for got, want in held:
        for g, w in zip(got, want):
            assert np.array_equal(_np(g), w)


def test_writes_in_place_and_never_copy_the_buffer():
    cache = ReservedKVCache(4096)
    k, v = mx.random.normal([1, 3, 1, 64]), mx.random.normal([1, 3, 1, 64])
    keys, values = cache.update_and_fetch(k, v)
    mx.eval(keys, values)
    del keys, values
    address = array_address(cache._keys._data)
    buffer_bytes = cache._keys._data.nbytes
    for _ in range(300):
        k, v = mx.random.normal([1, 3, 1, 64]), mx.random.normal([1, 3, 1, 64])
        mx.eval(k, v)
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        keys, values = cache.update_and_fetch(k, v)
        mx.eval((keys * 2).sum(), (values * 2).sum())  # read the views, as attention does
        # A copy of the buffer would allocate a second one of the same size.
        assert mx.get_peak_memory() - before < buffer_bytes // 4
        del keys, values
    assert array_address(cache._keys._data) == address


def test_generation_matches_full_cache_and_stays_in_place():
    model = _tiny_model()
    prompt = mx.array(np.random.default_rng(0).integers(0, 97, 20))
    ref = [t for t, _ in generate_step(prompt, model, max_tokens=40, prompt_cache=make_cache(model, "full"))]
    cache = make_cache(model, "reserved", max_context=128)
    addresses, tokens = set(), []
    for t, _ in generate_step(prompt, model, max_tokens=40, prompt_cache=cache):
        tokens.append(t)
        addresses.add(array_address(cache[0]._keys._data))
    assert tokens == ref
    assert len(addresses) == 1
    # generate_step computes one step ahead, so the cache holds prompt + 40 tokens.
    assert cache[0].offset == 60 and cache[0].nbytes == 2 * 2 * 60 * 32 * 4


def test_save_load_round_trip_continues_identically(tmp_path):
    model = _tiny_model(1)
    prompt = mx.array(np.random.default_rng(1).integers(0, 97, 30))
    cache = make_cache(model, "reserved", max_context=100)
    mx.eval(model(prompt[None], cache=cache))
    path = str(tmp_path / "prompt.safetensors")
    lm_cache.save_prompt_cache(path, cache)
    loaded = lm_cache.load_prompt_cache(path)
    assert [type(c) for c in loaded] == [ReservedKVCache] * 2
    assert [c.max_context for c in loaded] == [100, 100] and loaded[0].offset == 30
    nxt = mx.array([[5]])
    assert np.array_equal(np.array(model(nxt, cache=cache)), np.array(model(nxt, cache=loaded)))
    # The saved state is the live tokens, not the reservation.
    assert mx.load(path)["0.0.0"].shape == (1, 2, 30, 32)


def test_to_quantized_and_trim_protocol():
    model = _tiny_model(2)
    cache = make_cache(model, "reserved", max_context=64)
    mx.eval(model(mx.array([[1, 2, 3, 4, 5]]), cache=cache))
    assert lm_cache.can_trim_prompt_cache(cache)
    assert lm_cache.trim_prompt_cache(cache, 2) == 2 and cache[0].offset == 3
    q = cache[0].to_quantized(group_size=32, bits=8)
    assert isinstance(q, lm_cache.QuantizedKVCache) and q.offset == 3
    deq = mx.dequantize(*q.keys, group_size=32, bits=8)
    assert np.allclose(np.array(deq), np.array(cache[0].keys), atol=0.05)
    other = make_cache(model, "reserved", max_context=64)
    mx.eval(model(mx.array([[7, 8]]), cache=other))
    batch = cache[0].merge([cache[0], other[0]])  # what mlx-lm's batched generation does
    assert isinstance(batch, lm_cache.BatchKVCache) and batch.keys.shape[2] == 3
    assert np.array_equal(np.array(batch.keys[1:, :, 1:]), np.array(other[0].keys))


def test_past_max_context_raises_and_leaves_the_cache_unchanged():
    cache = ReservedKVCache(50)
    rng = np.random.default_rng(3)
    cache.update_and_fetch(*_random_kv(rng, 1, 2, 48, 8, 8, mx.float32))
    cache.update_and_fetch(*_random_kv(rng, 1, 2, 2, 8, 8, mx.float32))  # exactly full is fine
    before = _np(cache.keys)
    for L in (1, 7):
        with pytest.raises(ValueError, match=r"the cache is full: 50 tokens \+ \d+ new > max_context=50"):
            cache.update_and_fetch(*_random_kv(rng, 1, 2, L, 8, 8, mx.float32))
    assert cache.offset == 50 and np.array_equal(_np(cache.keys), before)
    with pytest.raises(ValueError, match="max_context=10"):
        ReservedKVCache(10).update_and_fetch(*_random_kv(rng, 1, 2, 11, 8, 8, mx.float32))
    cache.trim(5)
    cache.update_and_fetch(*_random_kv(rng, 1, 2, 5, 8, 8, mx.float32))  # room again after a trim
    with pytest.raises(ValueError, match=r"keys and values must agree"):
        cache.update_and_fetch(mx.zeros([1, 2, 1, 8]), mx.zeros([1, 2, 2, 8]))
    with pytest.raises(ValueError, match=r"values must be an mx.array of shape \(B, H, L, D\)"):
        cache.update_and_fetch(mx.zeros([1, 2, 1, 8]), mx.zeros([2, 1, 8]))


def test_bad_policy_sizes_are_clear_errors():
    model = _tiny_model()
    for bad in (0, -1, 1.5, True, "8", 2**31):
        with pytest.raises(ValueError, match="max_context must be an integer"):
            make_cache(model, "reserved", max_context=bad)
    with pytest.raises(ValueError, match=r"unknown option\(s\) max_kv_size for policy .reserved.; its options: max_context"):
        make_cache(model, "reserved", max_context=8, max_kv_size=4)
    assert [c.max_context for c in make_cache(model, "reserved")] == [256, 256]  # the model's context
    model.args.max_position_embeddings = None
    with pytest.raises(ValueError, match="needs max_context"):
        make_cache(model, "reserved")


@linux_only
def _vma_flags(address: int):
    """VmFlags of the mapping holding `address` (/proc/self/smaps), or None."""
    return next((fields.get("VmFlags") for lo, hi, _, fields in memory_maps() if lo <= address < hi), None)


@pytest.mark.skipif(not os.path.exists("/sys/kernel/mm/transparent_hugepage"), reason="no transparent huge pages")
def test_reservations_stay_in_small_pages():
    """A transparent huge page would commit 2 MiB at the first write into it (this made
    test_trim_and_reset_give_pages_back see 762 resident pages instead of 500 once): reservations
    are marked MADV_NOHUGEPAGE, whatever the heap range was marked before (NumPy marks its large
    buffers MADV_HUGEPAGE)."""
    for _ in range(3):
        big = np.ones(4 << 20)  # 32 MiB NumPy buffer: madvised for huge pages, then freed
        del big
        a = _ext.uninitialized([8 << 20], mx.float32)
        mx.eval(a)
        flags = _vma_flags(array_address(a))
        assert flags is not None and "nh" in flags and "hg" not in flags, flags


def test_trim_and_reset_give_pages_back():
    cache = ReservedKVCache(8192)
    rng = np.random.default_rng(4)
    cache.update_and_fetch(*_random_kv(rng, 1, 2, 4000, 64, 64, mx.float32))
    mx.eval(cache.keys)
    per_head = 4000 * 64 * 4
    assert _resident_pages(cache._keys._data) == 2 * -(-per_head // PAGE)
    cache.trim(3000)
    assert _resident_pages(cache._keys._data) == 2 * -(-1000 * 64 * 4 // PAGE)
    held = cache.keys  # a reader: nothing may be released under it
    cache.reset()
    assert _resident_pages(cache._keys._data) == 2 * -(-1000 * 64 * 4 // PAGE)
    del held
    cache.reset()
    assert _resident_pages(cache._keys._data) == 0 and cache.offset == 0 and cache.nbytes == 0


def test_cli_generate_passes_max_context():
    from mlx_h2o import cli

    args = cli.build_parser().parse_args(["generate", "--prompt", "x", "--kv-policy", "reserved", "--max-context", "64"])
    assert cli._cache_options(args) == {"max_context": 64}
    args = cli.build_parser().parse_args(["generate", "--prompt", "x", "--kv-policy", "rotating", "--max-kv-size", "8"])
    assert cli._cache_options(args) == {"max_kv_size": 8}
