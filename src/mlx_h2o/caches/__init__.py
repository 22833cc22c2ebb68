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


def loadable_by_mlx_lm(cls):
    """Class decorator: let mlx-lm's `load_prompt_cache` rebuild `cls`. It looks cache classes up
    by name in the `mlx_lm.models.cache` module, so the class is published there."""
    from mlx_lm.models import cache as lm_cache

    existing = getattr(lm_cache, cls.__name__, None)
    if existing is not None and existing.__module__ != cls.__module__:
        raise RuntimeError(f"mlx_lm.models.cache already has a {cls.__name__} ({existing.__module__})")
    setattr(lm_cache, cls.__name__, cls)
    return cls


def make_cache(model, policy: str = "full", **options):
    """Per-layer caches for `model` under `policy` (see `POLICIES` for the names)."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {policy!r}")
    return POLICIES[policy](model, **options)


from . import baseline  # noqa: E402,F401  (registers "full" and "rotating")
from . import reserved  # noqa: E402,F401  (registers "reserved")
