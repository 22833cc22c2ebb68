"""Every registered policy (and the h2o storage variants) against mlx-lm's cache protocol: generate,
save, load in a NEW Python process and continue token for token; trim, nbytes, make_mask (chunked
prefill), empty, reset. Cases come from the registry, so a new policy is covered without editing
this file (a policy with a required option other than max_kv_size must say how to fill it)."""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from decoding import continue_in_new_process, greedy, prefill
from mlx_lm.models import cache as lm_cache
from tiny_models import tiny_model

import mlx_h2o
from mlx_h2o.evaluation import kv_bytes

MODEL = dict(head_dim=64, hidden_size=128, max_position_embeddings=1024)  # head dim 64: every group size divides it
BUDGET = 24  # entries kept by bounded policies: well below the tokens fed, so they evict
PROMPT, FIRST, SECOND = 40, 12, 12  # tokens: prompt, generated before saving, generated after
FIXTURES = Path(__file__).parent / "fixtures"

# Storage variants, beyond the policies' defaults.
VARIANTS = [
    ("h2o", {"kv_bits": 8}),
    ("h2o", {"kv_bits": 4}),
    ("h2o", {"kv_bits": "mixed"}),
    ("h2o", {"rotate": True}),
    ("h2o", {"kv_bits": 4, "rotate": True}),
    ("h2o", {"evict_every": 4, "score": "ema", "pin": [(2, 6)]}),
    ("h2o", {"kv_bits": "k8v4"}),
    ("h2o", {"chunk": 4, "expected": 0.5, "redundancy": 0.5}),
    ("h2o", {"head_budget": "adaptive"}),
    ("h2o", {"head_budget": "adaptive", "kv_bits": "mixed", "evict_every": 2}),
    ("h2o", {"layer_budget": "pyramid"}),
    ("h2o", {"layer_budget": "dispersion"}),
    ("h2o", {"merge": 0.3, "evict_every": 3}),
    ("h2o", {"evicted_bits": 4, "rotate": True}),
    ("h2o", {"evicted_bits": "k8v4", "kv_bits": 8, "evicted_share": 0.25}),
    ("h2o", {"kv_dtype": "float16"}),
    ("h2o", {"kv_bits": "4/8", "rotate": True, "kv_dtype": "bfloat16"}),
    ("h2o", {"kv_bits": "4/8", "rotate": True, "kv_recent_rows": 4, "kv_sink_rows": 2, "center_keys": True}),
    ("full", {"kv_dtype": "float16"}),
    ("rotating", {"kv_dtype": "bfloat16"}),
]


def _cases():
    out = []
    for name, policy in sorted(mlx_h2o.POLICIES.items()):
        needed = [o.name for o in policy.options if o.required]
        assert set(needed) <= {"max_kv_size"}, f"tell test_policies how to fill {needed} of {name!r}"
        out.append((name, {"max_kv_size": BUDGET} if needed else {}))
    sized = lambda name: {"max_kv_size": BUDGET} if mlx_h2o.POLICIES[name].takes("max_kv_size") else {}
    return out + [(name, {**sized(name), **opts}) for name, opts in VARIANTS]


CASES = _cases()
IDS = [f"{name}-{'-'.join(f'{k}={v}' for k, v in opts.items() if k != 'max_kv_size') or 'default'}" for name, opts in CASES]


def _model():
    return tiny_model("llama", **MODEL)


def _prompt(seed=0, n=PROMPT):
    return np.random.default_rng(seed).integers(0, 128, n).tolist()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Every case generated, saved, continued in this process; then loaded and continued in one
    new process. Returns {case index: (reference tokens, reference logits, new-process job)}."""
    tmp = tmp_path_factory.mktemp("caches")
    model = _model()
    jobs, refs = [], {}
    for i, (name, opts) in enumerate(CASES):
        cache = mlx_h2o.make_cache(model, name, **opts)
        last = greedy(model, cache, prefill(model, cache, _prompt(i)), FIRST)[0][-1]
        path = str(tmp / f"case{i}.safetensors")
        lm_cache.save_prompt_cache(path, cache, {"case": IDS[i]})
        refs[i] = greedy(model, cache, last, SECOND)
        jobs.append({"case": i, "path": path, "last": last})
    fresh = {job["case"]: job for job in continue_in_new_process(jobs, SECOND, tmp, "llama", **MODEL)}
    return {i: (refs[i], fresh[i]) for i in refs}


@pytest.mark.parametrize("case", range(len(CASES)), ids=IDS)
def test_saved_cache_continues_identically_in_a_new_process(saved, case):
    (tokens, logits), fresh = saved[case]
    assert fresh["tokens"] == tokens
    np.testing.assert_allclose(fresh["logits"], logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name, opts", CASES, ids=IDS)
def test_protocol(name, opts):
    """empty/size/nbytes/trim/make_mask/reset, with a budget larger than the text (nothing evicted),
    where every policy must act like a full cache up to its storage precision."""
    model = _model()
    tokens = _prompt(7, 60)
    opts = {**opts, "max_kv_size": 256} if "max_kv_size" in opts else opts
    cache = mlx_h2o.make_cache(model, name, **opts)
    assert all(c.empty() for c in cache)
    prefill(model, cache, tokens[:30])
    assert not any(c.empty() for c in cache)
    n30 = kv_bytes(cache)
    prefill(model, cache, tokens[30:50])
    assert kv_bytes(cache) > n30 > 0

    # trim 10 (nothing evicted, so every policy can), then continue: as good as a cache of the same
    # policy that saw 40 tokens - equal for lossless storage; for low-bit storage the trimmed cache
    # may hold more packed rows (its window moved on before the trim), so it is held to the same
    # error against the full cache, with room to spare.
    assert lm_cache.can_trim_prompt_cache(cache)
    assert lm_cache.trim_prompt_cache(cache, 10) == 10
    ref, full = mlx_h2o.make_cache(model, name, **opts), mlx_h2o.make_cache(model, "full")
    for c in (ref, full):
        prefill(model, c, tokens[:30])
        prefill(model, c, tokens[30:40])
    # A multi-token call after trimming exercises make_mask(N > 1) against the held layout.
    chunk = mx.array([tokens[40:47]])
    got, want, exact = (np.array(model(chunk, cache=c)) for c in (cache, ref, full))
    assert np.abs(got - exact).max() <= 3 * np.abs(want - exact).max() + 1e-4
    for c in cache:
        mask = c.make_mask(5, return_array=True, window_size=None)
        assert mask is None or mask.shape[-2] == 5

    if all(hasattr(c, "reset") for c in cache):
        for c in cache:
            c.reset()
        assert all(c.empty() for c in cache)
        fresh = mlx_h2o.make_cache(model, name, **opts)
        np.testing.assert_array_equal(
            np.array(model(mx.array([tokens[:9]]), cache=cache)), np.array(model(mx.array([tokens[:9]]), cache=fresh))
        )


class _CountingEvals:
    """mlx.core as caches/base.py sees it, counting `eval` calls."""

    def __init__(self):
        self.evals = 0

    def eval(self, *arrays):
        self.evals += 1
        mx.eval(*arrays)


@pytest.mark.parametrize("name, opts", CASES, ids=IDS)
def test_a_prefill_chunk_is_evaluated_layer_by_layer(name, opts, monkeypatch):
    """Each layer's attention evaluates a call of PREFILL_EVAL_ROWS queries or more as it is built (the
    chunk's peak memory is then one layer's); shorter calls and decode steps stay lazy; the logits are
    those of the chunk evaluated at once."""
    from mlx_h2o.caches import base as caches_base

    model, tokens = _model(), _prompt(3, caches_base.PREFILL_EVAL_ROWS + 6)
    layers = len(model.layers)
    counting = _CountingEvals()
    monkeypatch.setattr(caches_base, "mx", counting)
    cache = mlx_h2o.make_cache(model, name, **opts)
    logits = model(mx.array([tokens]), cache=cache)
    assert counting.evals >= layers
    counting.evals = 0
    model(mx.array([tokens[:1]]), cache=cache)
    model(mx.array([tokens[: caches_base.PREFILL_EVAL_ROWS - 1]]), cache=mlx_h2o.make_cache(model, name, **opts))
    assert counting.evals == 0
    monkeypatch.setattr(caches_base, "PREFILL_EVAL_ROWS", 1 << 30)
    at_once = model(mx.array([tokens]), cache=mlx_h2o.make_cache(model, name, **opts))
    np.testing.assert_array_equal(np.array(logits), np.array(at_once))


def test_layer_by_layer_prefill_under_function_transformations():
    """mx.grad lets the evaluation happen inside; mx.compile and mx.vmap, which cannot evaluate, get the
    chunk lazy instead of an error."""
    from mlx_h2o.caches.base import PREFILL_EVAL_ROWS, LayerByLayerPrefill

    class Doubling(LayerByLayerPrefill):
        def attend(self, queries, keys, values, *, scale, mask=None, sinks=None):
            return queries * 2

    def f(q):
        return Doubling().attend(mx.sin(q), None, None, scale=1.0).sum()

    q = mx.array(np.random.default_rng(0).standard_normal((1, 2, PREFILL_EVAL_ROWS, 4)).astype(np.float32))
    np.testing.assert_allclose(np.array(mx.grad(f)(q)), 2 * np.cos(np.array(q)), rtol=1e-5)
    np.testing.assert_allclose(mx.compile(f)(q).item(), f(q).item(), rtol=1e-5)
    np.testing.assert_allclose(np.array(mx.vmap(f)(q[None])), np.array([f(q).item()]), rtol=1e-5)


@pytest.mark.slow
def test_layer_by_layer_prefill_holds_less_memory(monkeypatch):
    """MLX's peak memory over a 256-token chunk of the embedded model (full cache), with and without the
    layer-by-layer evaluation: evaluated at once, the graph holds several layers' temporaries together
    (+53 MiB against +35, K/V included; benchmarks/trace_prefill_memory.py)."""
    from mlx_h2o.caches import base as caches_base

    try:
        model, _ = mlx_h2o.load()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    tokens = mx.array([_prompt(5, 256)])

    def peak_above_active():
        cache = mlx_h2o.make_cache(model, "full")
        mx.clear_cache()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        model(tokens, cache=cache)  # as mlx-lm's generate_step prefills: the cache states evaluated, not the logits
        mx.eval([c.state for c in cache])
        return mx.get_peak_memory() - base

    by_layer = peak_above_active()
    monkeypatch.setattr(caches_base, "PREFILL_EVAL_ROWS", 1 << 30)
    at_once = peak_above_active()
    assert by_layer < 0.8 * at_once, (by_layer, at_once)


@pytest.mark.parametrize("name, opts", [c for c in CASES if mlx_h2o.POLICIES[c[0]].bounded], ids=lambda x: str(x))
def test_bounded_policies_hold_a_bounded_size(name, opts):
    model = _model()
    tokens = _prompt(3, 120)
    cache = mlx_h2o.make_cache(model, name, **opts)
    prefill(model, cache, tokens[:8])
    sizes = []
    for t in tokens[8:]:
        model(mx.array([[t]]), cache=cache)
        sizes.append(kv_bytes(cache))
    mx.eval([c.state for c in cache])
    slack = sum(e - s for s, e in opts.get("pin", ()))  # pinned entries are outside the budget
    # Per-layer budgets (h2o layer_budget) move entries between layers at the same total; an h2o
    # archive (evicted_bits) holds part of its layer's budget's bytes in a low-bit tier of archive_size entries.
    def budget(c, which):
        return getattr(c, which).max_kv_size if hasattr(c, which) else BUDGET

    assert sum(budget(c, "layer_budget") for c in cache) == BUDGET * len(cache)
    budgets = [budget(c, "budget") for c in cache]
    assert all(c.size() <= m + slack for c, m in zip(cache, budgets))
    # Steady state: the bytes held stop growing once the budget (and any archive) is full.
    full = max(m + (getattr(c, "archive_size", 0) or 0) for c, m in zip(cache, budgets)) + slack
    start = max(50, full - 8)
    assert start + 20 < len(sizes)
    assert max(sizes[start:]) <= max(sizes[start : start + 10]) + 1


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("saved_by_*/*.safetensors")), ids=lambda p: f"{p.parent.name}-{p.stem}")
def test_files_saved_by_older_releases_fail_with_a_clear_message(path):
    """0.1.0 wrote unversioned states; 0.2.0's h2o caches (H2OKVCache and its former subclasses
    AdaptiveHeadsKVCache and ArchiveKVCache) kept their bookkeeping beside the rows."""
    release = path.parent.name.removeprefix("saved_by_").replace(".", r"\.")
    with pytest.raises(ValueError, match=rf"saved by mlx-h2o {release} \(save format \d\).*recompute"):
        lm_cache.load_prompt_cache(str(path))
