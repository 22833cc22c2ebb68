"""The full cache batched (caches/shared_rows.py: SharedRowsBatch, SharedRowsKVCache): mlx-lm's
BatchGenerator (batch_generate and the server) gives each sequence exactly its own generation, and
requests forked from one prompt-cache snapshot hold its rows once."""

import copy

import mlx.core as mx
import numpy as np
import pytest
from decoding import VOCAB, continue_in_new_process, greedy, prefill
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models import cache as lm_cache
from tiny_models import tiny_model

import mlx_h2o
from mlx_h2o.caches.shared_rows import SharedRowsBatch, SharedRowsKVCache


def _alone(model, prompt, steps, prefill_step_size=2048):
    """mlx-lm's own generation of one sequence with its own (stock) caches."""
    cache = lm_cache.make_prompt_cache(model)
    return [int(y) for y, _ in generate_step(mx.array(prompt), model, max_tokens=steps, prompt_cache=cache,
                                             prefill_step_size=prefill_step_size)]


def _prompts(seed, lengths):
    return [np.random.default_rng(seed + i).integers(0, VOCAB, n).tolist() for i, n in enumerate(lengths)]


# llama: attention gets the rows as held (segments); deepseek_v3 (MLA) reads them, so it gets them
# joined; gemma3 and gpt_oss mix in sliding-window layers (mlx-lm's own batch caches).
@pytest.mark.parametrize("arch", ["llama", "deepseek_v3", "gemma3", "gpt_oss"])
@pytest.mark.parametrize("prefill_step_size", [2048, 16])
@pytest.mark.parametrize("late", ["fresh", "other snapshot"])
def test_batch_generator_equals_each_sequence_alone(arch, prefill_step_size, late, monkeypatch):
    """Two copies of a snapshot (a shared system prompt) and a fresh cache in one batch (one shared
    prefix, which the fresh sequence does not read), prompts of different lengths (right-padded
    together), sequences finishing early (filter), and a fourth joining late (extend): a fresh one
    (the prefix stays shared) or a copy of another snapshot (no prefix in common: one cache per
    sequence from then on). Every sequence generates what mlx-lm generates for it alone."""
    ungrouped = []
    monkeypatch.setattr(SharedRowsBatch, "_ungroup", lambda self, f=SharedRowsBatch._ungroup: ungrouped.append(self.grouped) or f(self))
    model = tiny_model(arch)
    systems = _prompts(30, [40, 25])
    snapshots = [mlx_h2o.make_cache(model, "full") for _ in systems]
    for system, snapshot in zip(systems, snapshots):
        mx.eval(model(mx.array(system)[None], cache=snapshot))
    questions = _prompts(31, (9, 4, 17, 6))
    prompts = [systems[0] + q for q in questions[:2]] + [questions[2]]
    prompts.append(questions[3] if late == "fresh" else systems[1] + questions[3])
    steps = [12, 5, 9, 10]
    want = [_alone(model, p, n, prefill_step_size) for p, n in zip(prompts, steps)]

    gen = BatchGenerator(model, stop_tokens=[], prefill_step_size=prefill_step_size)
    caches = [copy.deepcopy(snapshots[0]) for _ in range(2)] + [mlx_h2o.make_cache(model, "full")]
    caches.append(mlx_h2o.make_cache(model, "full") if late == "fresh" else copy.deepcopy(snapshots[1]))
    uids = gen.insert(questions[:2] + prompts[2:3], steps[:3], caches=caches[:3])
    got, finished, joined = {u: [] for u in uids}, {}, None
    while len(finished) < len(prompts):
        for r in gen.next_generated():
            got.setdefault(r.uid, []).append(r.token)
            if r.finish_reason is not None:
                finished[r.uid] = r.prompt_cache
        if joined is None and finished:
            joined = gen.insert(questions[3:] if late != "fresh" else prompts[3:], steps[3:], caches=caches[3:])[0]
    gen.close()
    assert [got[u] for u in uids + [joined]] == want
    for i, uid in enumerate(uids + [joined]):  # each holds its tokens (the last one fed, as it finished)
        full = [c for c in finished[uid] if isinstance(c, SharedRowsKVCache)]
        assert full and {c.offset for c in full} == {len(prompts[i]) + steps[i]}
    assert bool(ungrouped) == (late != "fresh")


def test_requests_forked_from_one_snapshot_hold_its_rows_once(tmp_path):
    """8 requests behind one system prompt, through BatchGenerator: copies of the snapshot add their
    own tokens' rows and transients only, less than one snapshot all together (mlx-lm's
    BatchKVCache added 8 snapshots and padding); independent copies (loaded from a file) add 8.
    Both generate the same."""
    model = tiny_model("llama", hidden_size=256, num_attention_heads=8, num_key_value_heads=8, head_dim=64)
    system = _prompts(40, [600])[0]
    snapshot = mlx_h2o.make_cache(model, "full")
    for i in range(0, len(system), 128):
        mx.eval(model(mx.array(system[i : i + 128])[None], cache=snapshot))
    path = str(tmp_path / "system.safetensors")
    lm_cache.save_prompt_cache(path, snapshot)
    questions = _prompts(41, [5 + i for i in range(8)])
    snapshot_bytes = sum(c.nbytes for c in snapshot)

    def run(caches):
        mx.clear_cache()
        base = mx.get_active_memory()
        gen = BatchGenerator(model, stop_tokens=[], prefill_step_size=128)
        gen.insert(questions, [8] * len(questions), caches=caches)
        del caches[:]
        tokens, peak, left = [], 0, len(questions)
        while left:
            for r in gen.next_generated():
                tokens.append((r.uid, r.token))
                left -= r.finish_reason is not None
            peak = max(peak, mx.get_active_memory() - base)
        gen.close()
        return sorted(tokens), peak

    shared, shared_peak = run([copy.deepcopy(snapshot) for _ in questions])
    independent, independent_peak = run([lm_cache.load_prompt_cache(path) for _ in questions])
    assert shared == independent
    assert independent_peak > 6 * snapshot_bytes  # each loaded copy holds its own rows
    assert shared_peak < snapshot_bytes, (shared_peak, snapshot_bytes)  # all 8 together: less than one more


def _extracted(model, system, question, steps):
    """A SharedRowsKVCache list as a batch hands it back (a copy of a snapshot, then its own tokens),
    and the tokens generated."""
    snapshot = mlx_h2o.make_cache(model, "full")
    mx.eval(model(mx.array(system)[None], cache=snapshot))
    gen = BatchGenerator(model, stop_tokens=[])
    gen.insert([question, question[:3]], [steps, 2], caches=[copy.deepcopy(snapshot), copy.deepcopy(snapshot)])
    tokens, cache = [], None
    while cache is None:
        for r in gen.next_generated():
            if r.uid == 0:
                tokens.append(r.token)
                cache = r.prompt_cache if r.finish_reason is not None else None
    gen.close()
    assert all(isinstance(c, SharedRowsKVCache) and c.rows.shared_length for c in cache)
    return cache, tokens


def test_a_batch_hands_back_a_full_cache(tmp_path):
    """What a batch hands back (the server keeps it as the next snapshot) is a full cache: it
    continues as a stock KVCache of the same tokens does; a copy continues independently; it trims
    into its shared rows as the stock cache trims; it saves, loads in a new process and continues
    there."""
    model = tiny_model("llama")
    system, question = _prompts(50, [30])[0], _prompts(51, [7])[0]
    cache, tokens = _extracted(model, system, question, 6)
    held = system + question + tokens
    assert [c.offset for c in cache] == [len(held)] * len(cache)
    stock = lm_cache.make_prompt_cache(model)
    nxt = prefill(model, stock, held)
    twin, trimmed, stock_trimmed = copy.deepcopy(cache), copy.deepcopy(cache), copy.deepcopy(stock)
    twin_before_trim = copy.deepcopy(cache)
    path = str(tmp_path / "extracted.safetensors")
    lm_cache.save_prompt_cache(path, cache)

    want = greedy(model, stock, nxt, 5)
    got = greedy(model, cache, nxt, 5)
    assert got[0] == want[0]
    np.testing.assert_allclose(got[1], want[1], atol=1e-4)
    np.testing.assert_allclose(greedy(model, twin, nxt, 5)[1], got[1], atol=1e-5)
    (job,) = continue_in_new_process([{"path": path, "last": nxt}], 5, tmp_path)
    assert job["classes"] == ["SharedRowsKVCache"] * len(cache) and job["tokens"] == got[0]
    np.testing.assert_allclose(job["logits"], got[1], atol=1e-4)

    assert trimmed[0].rows.shared_length == len(held)  # every row shared: the trim cuts into them
    for c in (trimmed, stock_trimmed):
        assert lm_cache.can_trim_prompt_cache(c) and lm_cache.trim_prompt_cache(c, 20) == 20
    assert trimmed[0].offset == stock_trimmed[0].offset == len(held) - 20
    # mlx-lm's prompt cache trims a copy of a conversation back to a shorter prompt: the rows stay
    # shared (no copy), and copies trimmed alike read one head piece, so a batch holds it once.
    again = copy.deepcopy(twin_before_trim)
    lm_cache.trim_prompt_cache(again, 20)
    assert all(c.rows.shared_length == len(held) - 20 and c.rows.own() is None for c in trimmed)
    assert [c.rows.shared for c in again] == [c.rows.shared for c in trimmed]
    batch = SharedRowsBatch.merge([trimmed[0], again[0]])
    assert batch.grouped and [p.length for p in batch.prefix] == [len(held) - 20] and batch.tails.keys is None
    a, b = greedy(model, trimmed, held[-20], 4), greedy(model, stock_trimmed, held[-20], 4)
    assert a[0] == b[0]
    np.testing.assert_allclose(a[1], b[1], atol=1e-4)


def test_merge_rejects_what_it_cannot_hold():
    model = tiny_model("llama")
    batch = lm_cache.KVCache()
    batch.update_and_fetch(mx.zeros((2, 2, 3, 16)), mx.zeros((2, 2, 3, 16)))
    with pytest.raises(ValueError, match="single-sequence"):
        SharedRowsBatch.merge([batch])
    with pytest.raises(ValueError, match="made from an mlx-lm KVCache"):
        SharedRowsKVCache.of(lm_cache.RotatingKVCache(8))
    assert isinstance(mlx_h2o.make_cache(model, "full")[0].merge([lm_cache.KVCache()]), SharedRowsBatch)
