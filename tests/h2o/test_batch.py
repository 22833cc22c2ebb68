"""Batched sequences in the h2o cache (caches/h2o/batch.py): each row of a batch is evicted on its
own, and mlx-lm's BatchGenerator (continuous batching) gives each sequence its own generation."""

import mlx.core as mx
import numpy as np
import pytest
from decoding import VOCAB, step_logits, tokens
from mlx_lm.generate import generate_step
from tiny_models import tiny_model

import mlx_h2o
from mlx_h2o.caches.h2o import H2OKVCache


@pytest.mark.parametrize("select", ["head", "layer"])
def test_batch_sequences_are_evicted_independently(select):
    model = tiny_model("qwen3")
    x = tokens(120, seed=5, batch=3)
    opts = dict(max_kv_size=20, select=select, evict_every=2)
    batched = step_logits(model, x, mlx_h2o.make_cache(model, "h2o", **opts))
    for b in range(3):
        alone = step_logits(model, x[b : b + 1], mlx_h2o.make_cache(model, "h2o", **opts))
        np.testing.assert_allclose(batched[b : b + 1], alone, atol=1e-4)


def _generate_alone(model, prompt, steps, prefill_step_size=2048, **options):
    cache = mlx_h2o.make_cache(model, "h2o", **options)
    out = []
    for y, _ in generate_step(mx.array(prompt), model, max_tokens=steps, prompt_cache=cache,
                              prefill_step_size=prefill_step_size):
        out.append(int(y))
    return out


@pytest.mark.parametrize("prefill_step_size", [2048, 16])
def test_batch_generator_equals_each_sequence_alone(prefill_step_size):
    """mlx-lm's BatchGenerator (continuous batching, as batch_generate and the server use it):
    prompts of different lengths (right-padded together), sequences that finish early (filter)
    and join late (extend); each sequence's tokens equal its own generation, and the finished
    sequences' caches (extract) held at most the budget. In steps of 16 tokens the prompts are
    chunked and evicted along the way, and (patched mlx-lm) the short one is processed apart."""
    from mlx_lm.generate import BatchGenerator

    model = tiny_model("llama")
    M = 24
    prompts = [np.random.default_rng(20 + i).integers(0, VOCAB, n).tolist() for i, n in enumerate((40, 9, 70, 33))]
    steps = [30, 12, 25, 40]
    want = [_generate_alone(model, p, n, prefill_step_size, max_kv_size=M, evict_every=3) for p, n in zip(prompts, steps)]
    gen = BatchGenerator(model, stop_tokens=[], prefill_batch_size=3, completion_batch_size=3,
                         prefill_step_size=prefill_step_size)
    caches = [mlx_h2o.make_cache(model, "h2o", max_kv_size=M, evict_every=3) for _ in prompts]
    uids = gen.insert(prompts[:3], steps[:3], caches=caches[:3])
    got, finished, late = {u: [] for u in uids}, {}, None
    while len(finished) < len(prompts):
        for r in gen.next_generated():
            got.setdefault(r.uid, []).append(r.token)
            if r.finish_reason is not None:
                finished[r.uid] = r.prompt_cache
        if late is None and finished:  # a fourth request joins while the others decode
            late = gen.insert(prompts[3:], steps[3:], caches=caches[3:])[0]
    gen.close()
    assert [got[u] for u in uids + [late]] == want
    for cache in finished.values():
        assert all(isinstance(c, H2OKVCache) and c.size() <= min(M + 2, c.offset) for c in cache)
    assert sorted(max(c.offset for c in cache) for cache in finished.values()) == sorted(len(p) + n for p, n in zip(prompts, steps))


@pytest.mark.parametrize("options", [dict(max_kv_size=1024), dict(max_kv_size=40),
                                     dict(max_kv_size=1024, kv_bits="8/4", evicted_bits="4"),
                                     dict(max_kv_size=40, kv_bits="8/4", evicted_bits="4")])
def test_requests_forked_from_one_snapshot_generate_as_independent_copies(options, tmp_path):
    """mlx-lm's server deep-copies a prompt-cache snapshot (a shared system prompt) for each request:
    the copies share its rows (storage/kv.py) and generate exactly what independent copies loaded
    from a file generate, whether they evict (M = 40: each copies the rows before compacting them)
    or not (M = 1024: the rows stay shared), in one format or two tiers with an archive (more
    segments than the fused op takes, until the copies join their pieces)."""
    import copy

    from mlx_lm.generate import BatchGenerator
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    model = tiny_model("llama", head_dim=32)  # packed rows: whole groups of 32
    system = np.random.default_rng(30).integers(0, VOCAB, 150).tolist()
    snapshot = mlx_h2o.make_cache(model, "h2o", evict_every=3, **options)
    mx.eval(model(mx.array(system)[None], cache=snapshot))
    snapshot = copy.deepcopy(copy.deepcopy(snapshot))  # a snapshot of a snapshot: rows in pieces
    save_prompt_cache(str(tmp_path / "system.safetensors"), snapshot)
    prompts = [np.random.default_rng(31 + i).integers(0, VOCAB, n).tolist() for i, n in enumerate((9, 4, 17))]

    def generate(caches):
        gen = BatchGenerator(model, stop_tokens=[])
        uids = gen.insert(prompts, [12] * len(prompts), caches=caches)
        got = {u: [] for u in uids}
        while any(len(t) < 12 for t in got.values()):
            for r in gen.next_generated():
                got[r.uid].append(r.token)
        gen.close()
        return [got[u] for u in uids]

    independent = generate([load_prompt_cache(str(tmp_path / "system.safetensors")) for _ in prompts])
    assert generate([copy.deepcopy(snapshot) for _ in prompts]) == independent
