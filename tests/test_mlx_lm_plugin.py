"""mlx-h2o's policies as mlx-lm cache-policy plugins (src/mlx_h2o/mlx_lm_plugin.py).

With stock mlx-lm (the global environment) the module still imports and its policies build caches
(the hook path). With the patched wheel (build/venv-fork, ci/run.sh, marker patched_mlx_lm)
mlx-lm finds them through the entry points, dispatches attention to `attend` without the hook, and
saves/loads their caches."""

import importlib.util
import tomllib
from pathlib import Path

import mlx.core as mx
import pytest
from decoding import greedy, prefill

import mlx_h2o
from mlx_h2o import hook, mlx_lm_plugin

PATCHED = importlib.util.find_spec("mlx_lm.models.cache_policies") is not None
patched_only = pytest.mark.skipif(not PATCHED, reason="needs the patched mlx-lm wheel (ci/run.sh runs it in build/venv-fork)")
PROTOCOL = ("name", "summary", "options", "parse_options", "make", "cache_classes")


def _declared_entry_points():
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    return pyproject["project"]["entry-points"]["mlx_lm.cache_policies"]


def test_pyproject_declares_every_policy_mlx_lm_lacks_and_full():
    declared = _declared_entry_points()
    assert sorted(declared) == mlx_lm_plugin.registered_names()
    assert "full" in declared and "rotating" not in declared
    for name, target in declared.items():
        module, attr = target.split(":")
        assert module == "mlx_h2o.mlx_lm_plugin"
        obj = getattr(mlx_lm_plugin, attr)
        assert all(hasattr(obj, a) for a in PROTOCOL), (name, obj)
        assert obj.name == name
        assert obj.replaces_builtin is (name == "full")  # (mlx-lm's own policy otherwise: an error)


def test_plugin_builds_the_same_caches_as_make_cache(smollm):
    model, _ = smollm
    caches = mlx_lm_plugin.h2o.make(model, **mlx_lm_plugin.h2o.parse_options({"max_kv_size": "64", "sink": "2"}))
    reference = mlx_h2o.make_cache(model, "h2o", max_kv_size=64, sink=2)
    assert [type(c) for c in caches] == [type(c) for c in reference]
    assert caches[0].config == reference[0].config
    with pytest.raises(ValueError, match="sink"):
        mlx_lm_plugin.h2o.make(model, max_kv_size=64, sinks=3)


def test_options_as_mlx_lm_lists_them():
    options = {o.name: o for o in mlx_lm_plugin.h2o.options}
    assert [o.name for o in mlx_lm_plugin.h2o.options] == [o.name for o in mlx_h2o.POLICIES["h2o"].options]
    assert options["max_kv_size"].type("512") == 512 and options["max_kv_size"].default == "required"
    assert "integer" in options["max_kv_size"].type.__name__
    # split is unset by default: heavy under max_kv_size, the byte rule's under max_kv_bytes
    assert options["split"].default is None and "balanced" in options["split"].choices and options["sink"].default == 4
    assert options["max_kv_size"].choices is None
    with pytest.raises(ValueError, match="max_kv_size"):
        options["max_kv_size"].type("lots")
    with pytest.raises(ValueError, match="split"):
        mlx_lm_plugin.h2o.parse_options({"split": "sideways"})


def _greedy(model, tokens, caches, steps=12):
    """`steps` greedy tokens after `tokens` (and one more call, which feeds the last of them)."""
    first = prefill(model, caches, tokens)
    return [first] + greedy(model, caches, first, steps)[0][:-1]


@pytest.mark.patched_mlx_lm
@patched_only
def test_mlx_lm_finds_the_policies_through_entry_points(smollm):
    from mlx_lm.models import cache_policies
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = smollm
    names = cache_policies.policy_names()
    assert set(mlx_lm_plugin.registered_names()) <= set(names), names
    assert "h2o:" in cache_policies.describe_policies()
    caches = make_prompt_cache(model, 64, policy="h2o")
    assert type(caches[0]).__name__ == "H2OKVCache" and caches[0].config.budget.max_kv_size == 64
    with pytest.raises(ValueError, match="installed policies: .*h2o"):
        make_prompt_cache(model, policy="h2o-typo")
    # "full" is ours (every token; batches share forked prefixes), named as replacing mlx-lm's;
    # no policy keeps mlx-lm's default caches.
    assert "share its rows (replaces mlx-lm's built-in)" in cache_policies.describe_policies()
    assert {type(c).__name__ for c in make_prompt_cache(model, policy="full")} == {"FusedKVCache"}
    assert {type(c).__name__ for c in make_prompt_cache(model)} == {"KVCache"}


@pytest.mark.patched_mlx_lm
@patched_only
def test_native_dispatch_equals_the_hook(smollm, licence_tokens):
    """The patched base.scaled_dot_product_attention reaches attend() itself (mlx-h2o's probe sees it
    and leaves mlx-lm's code alone): the same greedy tokens and evictions as through the hook's code
    swap, scores seen (not the sliding-window fallback)."""
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = smollm
    tokens = licence_tokens[:200]
    assert hook.MLX_LM_CALLS_ATTEND
    native = make_prompt_cache(model, 48, policy="h2o")
    assert hook._target.__code__ is hook._original_code  # no code swap
    got = _greedy(model, tokens, native)
    hooked = make_prompt_cache(model, 48, policy="h2o")
    hook._swap()
    try:
        expected = _greedy(model, tokens, hooked)
    finally:
        hook.remove()
    assert got == expected
    assert all(not c.scoreless for c in native)
    assert [c.evictions for c in native] == [c.evictions for c in hooked]
    assert native[0].evictions > 0


@pytest.mark.patched_mlx_lm
@patched_only
def test_h2o_prompt_cache_saves_and_loads(smollm, licence_tokens, tmp_path, monkeypatch):
    """load_prompt_cache finds H2OKVCache through the policy's cache_classes, not through
    mlx_lm.models.cache's globals (where the hook path's register_cache_class puts it)."""
    from mlx_lm.models import cache as lm_cache
    from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache

    monkeypatch.delattr(lm_cache, "H2OKVCache", raising=False)

    model, _ = smollm
    caches = make_prompt_cache(model, 48, policy="h2o")
    model(mx.array(licence_tokens[:100])[None], cache=caches)
    path = str(tmp_path / "h2o.safetensors")
    save_prompt_cache(path, caches)
    loaded = load_prompt_cache(path)
    assert [type(c) for c in loaded] == [type(c) for c in caches]
    step = mx.array(licence_tokens[100:101])[None]
    assert mx.array_equal(model(step, cache=caches), model(step, cache=loaded))


def test_h2o_cache_restores_the_other_releases_way(smollm, licence_tokens):
    """Other mlx-lm releases save `meta_state` beside `state` and restore with
    `obj.state = state; obj.meta_state = meta_state` (0.32.2 and the patched wheel: `state` only)."""
    model, _ = smollm
    caches = mlx_h2o.make_cache(model, "h2o", max_kv_size=48)
    model(mx.array(licence_tokens[:80])[None], cache=caches)

    def restore(c):
        obj = type(c).__new__(type(c))
        obj.state = c.state
        obj.meta_state = c.meta_state
        return obj

    restored = [restore(c) for c in caches]
    assert [c.offset for c in restored] == [c.offset for c in caches]
    step = mx.array(licence_tokens[80:81])[None]
    assert mx.array_equal(model(step, cache=restored), model(step, cache=caches))


@patched_only
@pytest.mark.parametrize("policy, options", [
    ("full", {}),
    ("rotating", {"max_kv_size": "64"}),
    ("h2o", {"max_kv_size": "64"}),
    ("h2o", {"max_kv_bytes": "3MB"}),
    ("quantized", {}),
    ("reserved", {}),
    ("rotated", {}),
])
def test_server_kv_budget_reserves_at_least_what_each_policy_holds(smollm, licence_tokens, policy, options):
    """mlx_lm.server --kv-budget-bytes (mlx-lm patch 0008) reserves, per request, the most its caches
    can hold; with mlx-h2o's policies too, prompt chunks and decode steps included."""
    from mlx_lm import server
    from mlx_lm.models import cache_policies
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = smollm
    options = cache_policies.get_policy(policy).parse_options(options)
    budget = server.KVBudget(1 << 40, wait=1.0)
    tokens = mx.array(licence_tokens[:700])[None]
    for step in (64, 256):
        caches = make_prompt_cache(model, policy=policy, **options)
        held = 0
        for i in range(0, tokens.shape[1], step):
            model(tokens[:, i:i + step], caches)
            mx.eval([c.state for c in caches])
            held = max(held, sum(c.nbytes for c in caches))
        for _ in range(8):
            model(tokens[:, -1:], caches)
            mx.eval([c.state for c in caches])
            held = max(held, sum(c.nbytes for c in caches))
        need = budget.request_bytes(model, tokens.shape[1] + 8, options, step)
        assert 0 < held <= need, (policy, options, step, held, need)
