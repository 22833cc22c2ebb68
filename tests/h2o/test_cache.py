"""The h2o cache as a whole (caches/h2o/cache.py): the evicted layout against a full cache masked to
the kept positions, the seed's offset bug, reset and trim, the hook and its fallback, save/load,
pinned spans, long prompts, mlx-lm integration on tiny models of many architectures, a 16K soak."""

import copy
import warnings

import mlx.core as mx
import numpy as np
import pytest
from attention_reference import float_queries
from decoding import greedy, lockstep, step_logits, tokens
from mlx_lm.generate import generate_step
from mlx_lm.models import cache as lm_cache
from tiny_models import CONFIGS, tiny_model

import mlx_h2o
from mlx_h2o import hook
from mlx_h2o.caches.h2o import H2OConfig, H2OKVCache

from .references import column, kept_positions


def _h2o_layers(cache):
    return [c for c in cache if isinstance(c, H2OKVCache)]


def test_a_decode_step_reads_dense_rows_in_place():
    """A dense h2o store's rows reach the fused kernel as its buffers (DenseRows), not as the slices
    update_and_fetch hands the model: two primitives fewer a layer in a decode step that evicts
    nothing, the same logits."""
    from mlx_h2o.evaluation.speed import graph_primitives
    from mlx_h2o.storage.kv import KVStore

    model = tiny_model("llama")

    def step():
        cache = mlx_h2o.make_cache(model, "h2o", max_kv_size=64)
        mx.eval(model(mx.array([list(range(1, 21))]), cache=cache))
        out = model(mx.array([[5]]), cache=cache)
        return graph_primitives(out).get("Slice", 0), np.array(out)

    slices, in_place = step()
    attended = KVStore.attended
    try:
        KVStore.attended = lambda self, fetched: None  # attention reads the slices instead
        slices_then, sliced = step()
    finally:
        KVStore.attended = attended
    assert slices_then - slices == 2 * len(model.layers)
    np.testing.assert_array_equal(in_place, sliced)


# ----------------------------------------------------------------------------- the evicted layout
class SeedOffsetBug(H2OKVCache):
    """The MLX seed's bug: the logical offset reset to the physical length after eviction."""

    def _evict(self, keep, capacity):
        super()._evict(keep, capacity)
        self.offset = self.length


def test_evicted_layout_equals_full_cache_masked_to_kept_positions():
    model = tiny_model("llama")
    x = tokens(140, seed=3, batch=2)
    cache = mlx_h2o.make_cache(model, "h2o", max_kv_size=24, evict_every=3)
    # Multi-row calls after eviction exercise the causal mask over the evicted layout.
    assert lockstep(model, x, cache, kept_positions(cache), chunk_at=(60, 100)) < 1e-4
    c = cache[0]
    assert c.offset == 140 and c.length <= 24 + 2 and c.evictions > 10


def test_seed_offset_reset_bug_cannot_happen():
    model = tiny_model("llama")
    x = tokens(100, seed=4, batch=1)
    cfg = H2OConfig.build(24)
    cache = [H2OKVCache(cfg) for _ in model.layers]
    assert lockstep(model, x, cache, kept_positions(cache)) < 1e-4
    for c in cache:
        assert c.offset == 100 and c.size() == 24  # logical position vs physical length
        planned = c.budget.keep_count(c.length, c.offset, 4)
        assert c.make_mask(4, return_array=True).shape == (4, (c.length if planned is None else planned) + 4)
    # The same check catches the seed's bug: its offset falls back to the physical length.
    buggy = [SeedOffsetBug(cfg) for _ in model.layers]
    assert lockstep(model, x, buggy, kept_positions(buggy)) > 1e-2


def test_layers_compact_at_staggered_steps_and_realign_for_a_multi_token_call():
    """The policy gives each layer its own decode step to compact (one layer's compaction a step,
    not every layer's every evict_every steps); none holds more than M, and a multi-token call
    brings them back to one length, so the mask one layer plans (return_array) fits every layer."""
    model = tiny_model("llama")
    M, e, N = 24, 4, 3
    x = tokens(80, seed=5, batch=1)
    cache = mlx_h2o.make_cache(model, "h2o", max_kv_size=M, evict_every=e)
    phases = [c.evict_phase for c in cache]
    assert len(set(phases)) == len(cache) > 1
    model(x[:, :8], cache=cache)
    residues, lengths = [set() for _ in cache], set()
    for i in range(8, 59):
        before = [c.evictions for c in cache]
        mx.eval(model(x[:, i : i + 1], cache=cache))
        for j, c in enumerate(cache):
            assert c.length <= M
            if c.evictions > before[j]:
                residues[j].add((c.offset - 1 + phases[j]) % e)
        lengths.add(tuple(c.length for c in cache))
    assert residues == [{0}] * len(cache)  # each layer always on its own step of the period
    assert any(len(set(held)) > 1 for held in lengths)  # so the layers held different counts
    mask = cache[0].make_mask(N, return_array=True)
    mx.eval(model(x[:, 59 : 59 + N], cache=cache))
    assert {c.length for c in cache} == {M - e + N} and mask.shape == (N, M - e + N)


# ----------------------------------------------------------------------------- architectures
@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_architecture_generates_with_bounded_cache(arch):
    model = tiny_model(arch)
    M, e = 64, 4
    cache = mlx_h2o.make_cache(model, "h2o", max_kv_size=M, evict_every=e)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        generated = [t for t, _ in generate_step(tokens(20, seed=1), model, max_tokens=300, prompt_cache=cache)]
    assert len(generated) == 300
    layers = _h2o_layers(cache)
    assert layers and all(c.peak <= M and c.evictions > 0 for c in layers)
    assert all(c.offset >= 20 + 299 for c in layers)  # generate_step runs one step ahead
    # Sliding-window layers keep their own cache (attended by the fused kernel, as every policy's).
    kinds = {type(c).__name__ for c in cache}
    assert kinds == ({"H2OKVCache", "FusedRotatingKVCache"} if arch in ("gemma3", "gpt_oss") else {"H2OKVCache"})
    inline = arch == "gemma2"  # mlx-lm's gemma2 attends inline: no scores, a warned fallback
    assert all(c.scoreless == inline for c in layers)
    assert any("no attention scores" in str(w.message) for w in caught) == inline

    # Nothing evicted (M >= length): the same logits as the model's own cache.
    x = tokens(70, seed=2, batch=2)
    full = step_logits(model, x, mlx_h2o.make_cache(model, "full"))
    h2o = step_logits(model, x, mlx_h2o.make_cache(model, "h2o", max_kv_size=128))
    np.testing.assert_allclose(h2o, full, atol=1e-4 * max(1.0, np.abs(full).max()))


@pytest.mark.parametrize("arch", ["deepseek_v3", "gpt_oss", "gemma3"])
def test_mla_sinks_and_sliding_layers_match_masked_reference(arch):
    model = tiny_model(arch)
    cache = mlx_h2o.make_cache(model, "h2o", max_kv_size=20, evict_every=2)
    assert lockstep(model, tokens(80, seed=6, batch=2), cache, kept_positions(cache), chunk_at=(40,)) < 1e-4
    assert all(c.evictions > 10 for c in _h2o_layers(cache))


def test_long_prompt_prefilled_in_chunks_stays_bounded():
    # The bound holds from the second chunk on, whatever the length (benchmarks/bench_h2o.py runs 32K).
    model = tiny_model("llama")
    M, chunk, n = 64, 256, 8192
    cache = mlx_h2o.make_cache(model, "h2o", max_kv_size=M)
    prompt = tokens(n, seed=7)
    steps = generate_step(prompt, model, max_tokens=4, prompt_cache=cache, prefill_step_size=chunk)
    assert len(list(steps)) == 4
    for c in _h2o_layers(cache):
        # A chunk is appended whole after an eviction down to M - evict_every.
        assert c.offset >= n + 3 and c.peak == M - c.budget.evict_every + chunk and c.size() <= M


def test_pinned_spans_are_never_evicted():
    model = tiny_model("llama")
    M, e, span = 24, 4, (3, 13)
    cache = mlx_h2o.make_cache(model, "h2o", max_kv_size=M, evict_every=e, pin=[span])
    step_logits(model, tokens(150, seed=8, batch=2), cache)
    for c in cache:
        pos = np.array(column(c, "pos"))
        assert all(set(range(*span)) <= set(row) for row in pos.reshape(-1, c.length))
        assert c.peak <= M + (span[1] - span[0])
    assert mlx_h2o.make_cache(model, "h2o", max_kv_size=M, pin="3:13;40:50")[0].config.budget.pin == ((3, 13), (40, 50))


def test_reset_and_trim():
    model = tiny_model("llama")
    x = tokens(60, seed=9, batch=1)
    cache = mlx_h2o.make_cache(model, "h2o", max_kv_size=16)
    assert hook.installed()
    first = step_logits(model, x, cache)
    for c in cache:
        c.reset()
        assert c.empty() and c.offset == 0 and c.size() == 0
    np.testing.assert_array_equal(step_logits(model, x, cache), first)
    # Trim the last 3 tokens (held: they are in the recent window); a longer trim stops where the
    # held tail of consecutive positions ends.
    c0 = cache[0]
    assert c0.is_trimmable() and [c.trim(3) for c in cache] == [3, 3] and c0.offset == 57
    pos = np.array(column(c0, "pos"))
    assert pos.max() == 56 and c0.length == 13
    run = next(k for k in range(1, 14) if not (pos[..., -k:] == np.arange(57 - k, 57)).all()) - 1
    assert c0.trim(100) == run and c0.offset == 57 - run and c0.length == 13 - run


@pytest.mark.skipif(hook.MLX_LM_CALLS_ATTEND, reason="the patched mlx-lm calls cache.attend itself: there is no hook to remove")
def test_without_the_hook_the_cache_falls_back():
    model = tiny_model("llama")
    x = tokens(60, seed=9, batch=1)
    mlx_h2o.make_cache(model, "h2o", max_kv_size=16)
    assert hook.installed()
    # With the hook removed the model never reaches attend(): the cache says so and falls back.
    fallback = [H2OKVCache(H2OConfig.build(16)) for _ in model.layers]
    hook.remove()
    try:
        with pytest.warns(RuntimeWarning, match="no attention scores"):
            step_logits(model, x, fallback)
        assert all(c.scoreless for c in fallback)
    finally:
        hook.install()
    # The hook is a no-op for mlx-lm's own caches (made by mlx-lm, not by a policy).
    full_hooked = step_logits(model, x, lm_cache.make_prompt_cache(model))
    hook.remove()
    full_plain = step_logits(model, x, lm_cache.make_prompt_cache(model))
    hook.install()
    np.testing.assert_array_equal(full_hooked, full_plain)


def test_save_load_round_trip_reproduces_generation(tmp_path):
    model = tiny_model("llama")
    prompt = tokens(40, seed=10)
    cache = mlx_h2o.make_cache(model, "h2o", max_kv_size=24, evict_every=4, score="ema", pin=[(2, 5)])
    last = None
    for last, _ in generate_step(prompt, model, max_tokens=20, prompt_cache=cache):
        pass
    path = str(tmp_path / "h2o.safetensors")
    lm_cache.save_prompt_cache(path, cache, metadata={"note": "h2o"})
    hook.remove()
    loaded, meta = lm_cache.load_prompt_cache(path, return_metadata=True)
    assert hook.installed() and meta == {"note": "h2o"}
    assert [type(c) for c in loaded] == [H2OKVCache] * len(cache)
    for a, b in zip(cache, loaded):
        assert (a.offset, a.length, a.config) == (b.offset, b.length, b.config)

    np.testing.assert_array_equal(greedy(model, loaded, last, 30)[1], greedy(model, cache, last, 30)[1])


def test_16k_decode_soak_holds_a_bounded_number_of_entries():
    """16,384 tokens decoded one at a time through h2o(M=256): the entries held never pass the
    budget (benchmarks/bench_h2o.py --soak records the process RSS of the same run)."""
    model = tiny_model("llama", num_hidden_layers=1)
    M, steps = 256, 16384
    cache = mlx_h2o.make_cache(model, "h2o", max_kv_size=M)
    y = tokens(32, seed=13, batch=1)
    for i in range(steps // 64):
        for _ in range(64):
            y = mx.argmax(model(y, cache=cache)[:, -1:], axis=-1)
        mx.eval(y, [column(c, "acc") for c in cache])
        assert all(c.size() <= M for c in cache), i
    assert all(c.offset == 32 + steps - 1 and c.peak <= M and c.evictions >= (steps - M) // c.budget.evict_every for c in cache)


def test_decoding_below_the_budget_does_not_accumulate_score_updates():
    """Score updates are nothing the model's values need: left unevaluated until an eviction reads
    them, each step's would chain the last one's, and memory would grow with every token (under a
    large M, for as long as nothing is evicted). The layer's output carries them (the score column's
    update is a sibling output of the op that passes it on, ColumnedKV.accumulate; the others are
    its dependencies, Lane.updates), so evaluating a step's tokens evaluates them: decoding within
    preallocated buffers holds constant memory."""
    model = tiny_model("llama")
    cache = mlx_h2o.make_cache(model, "h2o", max_kv_size=4096)
    y = mx.array([[3] * 20])
    used = []
    for step in range(160):  # 20 + 160 entries: within the first 256-row buffers
        y = mx.argmax(model(y, cache=cache)[:, -1:], axis=-1)
        mx.eval(y)
        used.append(mx.get_active_memory())
    assert used[-1] - used[20] < 16_000, f"{(used[-1] - used[20]) / 140:.0f} bytes more per step"


@pytest.mark.parametrize("options", [dict(), dict(kv_bits=4, rotate=True, score="ema"), dict(evicted_bits=2, score="cumulative")])
def test_a_decode_step_folds_its_scores_in_the_attention_op(options, monkeypatch):
    """A decode row's score update is an output of its attention primitive (Lane.attend, the op's
    score_column): no AccumulatePrefix in the step's graph where the lane has no archive, and the same
    logits and score columns, bit for bit, as the update by its own op (ColumnedKV.accumulate)."""
    from mlx_h2o.caches.h2o.scoring import ScoreRule
    from mlx_h2o.evaluation.speed import graph_primitives

    model = tiny_model("llama", head_dim=32)
    x = tokens(40, seed=7)[None]
    runs = {}
    for fold in (True, False):
        monkeypatch.setattr(ScoreRule, "folds_mass", property(lambda self, fold=fold: fold and type(self).stats is ScoreRule.stats))
        cache = mlx_h2o.make_cache(model, "h2o", max_kv_size=24, evict_every=4, **options)
        logits, y = [], mx.argmax(model(x, cache=cache)[:, -1:], axis=-1)
        mx.eval(y)
        for step in range(40):  # evicting every 4 tokens
            out = model(y, cache=cache)[:, -1:]
            if step == 0:
                counts = graph_primitives(out)
                assert (counts["AccumulatePrefix"] == 0) == (fold and "evicted_bits" not in options), counts
            y = mx.argmax(out, axis=-1)
            logits.append(np.array(out))
        runs[fold] = logits, [np.array(lane.store.column("acc")) for c in _h2o_layers(cache) for lane in c.lanes]
    for a, b in zip(runs[True][0] + runs[True][1], runs[False][0] + runs[False][1]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("options", [dict(), dict(kv_dtype="float32", select="layer"), dict(score="ema", sink=0),
                                     dict(kv_bits=4, rotate=True), dict(merge=0.9), dict(head_budget="adaptive")])
def test_a_decode_step_over_rows_of_its_own_skips_the_general_path(options, monkeypatch):
    """A decode step whose lane holds dense rows of its own with room (the default h2o) appends them
    in place (ColumnedKV.append_in_place) and attends them alone (Lane.attend_row), without the
    general path's Python: the same logits and score and position columns, bit for bit, as the
    general path (Lane.attend after ColumnedKV.append), evictions included. Other layouts take the
    general path."""
    from mlx_h2o.caches.h2o.lane import Lane
    from mlx_h2o.storage import ColumnedKV

    model = tiny_model("llama", head_dim=32)
    x = tokens(40, seed=5)[None]
    general_attends = Lane.attend
    runs = {}
    for general in (False, True):
        if general:
            monkeypatch.setattr(ColumnedKV, "append_in_place", lambda self, *a, **k: None)
            monkeypatch.setattr(Lane, "attend_row", lambda self, *a, **k: None)
        calls = []
        monkeypatch.setattr(Lane, "attend", lambda self, *a, **k: calls.append(1) or general_attends(self, *a, **k))
        cache = mlx_h2o.make_cache(model, "h2o", max_kv_size=24, evict_every=4, **options)
        logits, y = [], mx.argmax(model(x, cache=cache)[:, -1:], axis=-1)
        calls.clear()
        for step in range(40):  # evicting every 4 tokens
            out = model(y, cache=cache)[:, -1:]
            y = mx.argmax(out, axis=-1)
            logits.append(np.array(out))
        runs[general] = logits, [np.array(lane.store.column(name)) for c in _h2o_layers(cache) for lane in c.lanes for name in ("acc", "pos")]
        one_row = not general and not options.get("kv_bits") and "merge" not in options and "head_budget" not in options
        assert (len(calls) == 0) == one_row, (general, len(calls))
    for a, b in zip(runs[False][0] + runs[False][1], runs[True][0] + runs[True][1]):
        np.testing.assert_array_equal(a, b)


def test_a_cache_copied_step_after_step_attends_within_the_segment_limit():
    """Copies share rows in pieces (storage/kv.py): two tiers and an archive, copied at every step,
    would hand the fused op more segments than it takes; the lane joins them, and the copy attends
    as a cache never copied does."""
    from mlx_h2o._ops import MAX_SEGMENTS

    model = tiny_model("llama", head_dim=32)
    options = dict(max_kv_size=40, evict_every=8, kv_bits="8/fp", evicted_bits="4")
    copied, plain = (mlx_h2o.make_cache(model, "h2o", **options) for _ in range(2))
    x = tokens(150, seed=3)[None]
    for c in (copied, plain):
        mx.eval(model(x, cache=c))
    pieces = 0
    for t in range(12):
        copied = copy.deepcopy(copied)
        y = mx.array([[t + 1]])
        got, want = model(y, cache=copied), model(y, cache=plain)
        np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-4, rtol=1e-4)
        for lane in (lane for c in _h2o_layers(copied) for lane in c.lanes):
            assert len(lane.segments()) <= MAX_SEGMENTS
            pieces = max(pieces, len(lane.store.inner.low.shared) + len(lane.archive.inner.shared))
    assert pieces >= 2  # the rows were shared (the test would not see the limit otherwise)


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_every_architecture_decodes_from_a_copied_cache(arch):
    """A copy reads its rows in shared pieces (storage/kv.py): every architecture decodes from it as
    from the cache it copied, the models that read the rows themselves included (gemma2's inline
    attention, MLA's latent rows)."""
    model = tiny_model(arch)
    plain = mlx_h2o.make_cache(model, "h2o", max_kv_size=128, evict_every=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mx.eval(model(tokens(30, seed=4)[None], cache=plain))
        copied = copy.deepcopy(copy.deepcopy(plain))
        for t in range(6):
            y = mx.array([[t + 2]])
            got, want = model(y, cache=copied), model(y, cache=plain)
            np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-4 * max(1.0, np.abs(np.array(want)).max()))


def _live_positions(cache) -> np.ndarray:
    """(B, H, length) an h2o layer's held positions per kv head, ascending, dead rows (-1) left out."""
    pos = np.sort(np.array(column(cache, "pos")), axis=-1)
    live = pos[pos >= 0].reshape(*pos.shape[:2], -1)
    assert live.shape[-1] == cache.length
    return live


@pytest.mark.parametrize("options", [dict(), dict(select="layer"), dict(kv_bits="8", rotate=True)], ids=["head", "layer", "rotated-8bit"])
def test_copies_that_evict_hold_the_shared_prefix_once(options, tmp_path):
    """A copy's compaction keeps the prefix shared with the snapshot in place and marks the rows it
    drops as dead (storage/columns.py), while every head keeps most of it: it holds the entries a
    cache never copied holds, decodes the same logits, saves and loads, trims its newest tokens, and
    its own rows stay a fraction of M."""
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    model = tiny_model("llama", head_dim=32)
    M = 128
    snapshot = mlx_h2o.make_cache(model, "h2o", max_kv_size=M, evict_every=4, **options)
    mx.eval(model(tokens(300, seed=5)[None], cache=snapshot))
    plain, copied = copy.deepcopy(snapshot), copy.deepcopy(snapshot)
    for c in _h2o_layers(plain):
        for lane in c.lanes:
            lane.store.own_rows()  # a cache holding its rows itself: compactions copy, as before
    x = tokens(24, seed=6)
    # The two caches sum their segments in another order, so their activations differ by ~1e-6:
    # float32 queries for packed keys, since an int8 rounding of a query may flip (a step off by
    # ~4e-3); a new row's 8-bit rounding may still flip, and the row stays (up to ~2e-3 on the logits).
    tol = 1e-4 if "kv_bits" not in options else 5e-3
    with float_queries():
        for t in range(x.shape[0]):
            y = x[t : t + 1][None]
            got, want = model(y, cache=copied), model(y, cache=plain)
            np.testing.assert_allclose(np.array(got), np.array(want), atol=tol, rtol=tol)
    layers = _h2o_layers(copied)
    for c, p in zip(layers, _h2o_layers(plain)):
        np.testing.assert_array_equal(_live_positions(c), _live_positions(p))
        (lane,) = c.lanes
        assert lane.store.shared_length >= M - 4 and lane.store.dead_count > 0  # the prefix stayed, part of it dead
        assert lane.store.length - lane.store.shared_length < M // 4  # own rows: the new tokens, not a copy of M

    save_prompt_cache(str(tmp_path / "copy.safetensors"), copied)
    loaded = load_prompt_cache(str(tmp_path / "copy.safetensors"))
    assert [c.lanes[0].store.dead_count for c in _h2o_layers(loaded)] == [c.lanes[0].store.dead_count for c in layers]
    assert copied[0].trim(2) == 2 and plain[0].trim(0) == 0
    for c in layers[1:]:
        c.trim(2)
    with float_queries():
        for t in range(6):
            y = mx.array([[t + 1]])
            np.testing.assert_allclose(np.array(model(y, cache=loaded)), np.array(model(y, cache=plain)), atol=tol, rtol=tol)
    for c in _h2o_layers(copied):
        c.trim(0)
    assert all(c.offset == 300 + x.shape[0] - 2 for c in layers)


def test_a_copy_that_drops_most_of_the_prefix_copies_what_it_keeps():
    """Keeping the prefix in place pays while most of it is live: a copy whose heads keep less than
    half of it compacts into rows of its own, dead rows gone."""
    from mlx_h2o.storage import ColumnedKV, KVStore

    store = ColumnedKV(KVStore(None), {"acc": "float32", "pos": "int32"}, masks_shared=True)
    k = mx.random.normal((1, 2, 20, 8))
    store.append(k, k, acc=0.0, pos=range(20))
    twin = copy.deepcopy(store)
    twin.append(k[:, :, :2], k[:, :, :2], acc=0.0, pos=range(20, 22))
    # head 0 keeps 11 of the 20 shared rows and 1 of its own, head 1 10 and 2: own rows padded to 2
    twin.gather(mx.array([[list(range(11)) + [20], list(range(10)) + [20, 21]]]), 12)
    assert twin.shared_length == 20 and twin.length == 22 and twin.dead_count == 10 and twin.live_length == 12
    np.testing.assert_array_equal(np.array(twin.dead_rows()[0, :, 9:]), [[False, False] + [True] * 9 + [False, True],
                                                                         [False] + [True] * 10 + [False, False]])
    np.testing.assert_array_equal(np.array(twin.column("pos")[0, :, 19:]), [[-1, 20, -1], [-1, 20, 21]])
    np.testing.assert_array_equal(np.array(store.column("pos")), [[list(range(20))] * 2])  # the snapshot's own columns
    twin.gather(mx.array([[list(range(9)) + [20]] * 2]), 10)  # 9 of the 20 shared rows: below half
    assert twin.shared_length == 0 and twin.dead_rows() is None and twin.length == 10
    np.testing.assert_array_equal(np.array(twin.column("pos")), [[list(range(9)) + [20]] * 2])
