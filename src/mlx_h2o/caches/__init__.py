"""Cache policies: `make_cache(model, policy, **options)` -> one cache per layer, usable as
`prompt_cache=` in mlx-lm's generate functions.

Each policy lives in its own module and registers a `Policy` (options.py: its option table and a
builder) with `register_policy`; `POLICIES` maps names to them.
"""

from typing import Dict

from ..options import Policy

POLICIES: Dict[str, Policy] = {}


def register_policy(policy: Policy) -> Policy:
    POLICIES[policy.name] = policy
    for cls in policy.cache_classes:
        register_cache_class(cls)
    return policy


def register_cache_class(cls):
    """Make `cls` loadable by stock mlx-lm's `load_prompt_cache`, which looks cache classes up by name
    in `mlx_lm.models.cache` (the patched mlx-lm resolves them through the policy plugins instead)."""
    from mlx_lm.models import cache as lm_cache

    existing = getattr(lm_cache, cls.__name__, None)
    if existing is not None and existing is not cls and existing.__module__ != cls.__module__:
        raise RuntimeError(f"mlx_lm.models.cache already has a {cls.__name__} ({existing.__module__})")
    setattr(lm_cache, cls.__name__, cls)
    return cls


def per_layer_caches(model, make_layer_cache):
    """One cache per layer: `make_layer_cache(i)` (i counts the replaced layers) replaces each plain
    `KVCache` of the model's default layout; layers with their own layout (sliding-window, SSM state,
    MLA...) keep theirs, attended by the fused kernel where they are mlx-lm's dense caches."""
    from mlx_lm.models import cache as lm_cache

    from .baseline import with_fused_attention

    default = model.make_cache() if hasattr(model, "make_cache") else [lm_cache.KVCache() for _ in model.layers]
    out, index = [], 0
    for c in default:
        if type(c) is lm_cache.KVCache:
            c = make_layer_cache(index)
            index += 1
        out.append(with_fused_attention(c))
    return out


def make_cache(model, policy: str = "full", **options):
    """Per-layer caches for `model` under `policy` (see `POLICIES` for the names and their options)."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {policy!r}")
    return POLICIES[policy].make(model, **options)


from . import baseline, h2o, quantized, reserved, rotated  # noqa: E402,F401  (register their policies)
