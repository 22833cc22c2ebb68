"""Cache policies: `make_cache(model, policy, **options)` -> one cache per layer, usable as
`prompt_cache=` in mlx-lm's generate functions.

Each policy lives in its own module and registers a builder here with `register_policy`.
"""

from typing import Callable, Dict

POLICIES: Dict[str, Callable] = {}


def register_policy(name: str):
    def wrap(builder):
        POLICIES[name] = builder
        return builder

    return wrap


def register_cache_class(cls):
    """Make `cls` loadable by mlx-lm's `load_prompt_cache`, which looks cache classes up by name in
    `mlx_lm.models.cache`."""
    from mlx_lm.models import cache as lm_cache

    existing = getattr(lm_cache, cls.__name__, None)
    if existing is not None and existing.__module__ != cls.__module__:
        raise RuntimeError(f"mlx_lm.models.cache already has a {cls.__name__} ({existing.__module__})")
    setattr(lm_cache, cls.__name__, cls)
    return cls


def per_layer_caches(model, make_layer_cache):
    """One cache per layer: `make_layer_cache()` replaces each plain `KVCache` of the model's default
    layout; layers with their own layout (sliding-window, SSM state, MLA...) keep theirs."""
    from mlx_lm.models import cache as lm_cache

    if hasattr(model, "make_cache"):
        return [make_layer_cache() if type(c) is lm_cache.KVCache else c for c in model.make_cache()]
    return [make_layer_cache() for _ in model.layers]


def make_cache(model, policy: str = "full", **options):
    """Per-layer caches for `model` under `policy` (see `POLICIES` for the names)."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {policy!r}")
    return POLICIES[policy](model, **options)


from . import baseline, h2o, quantized, reserved, rotated  # noqa: E402,F401  (register their policies)
