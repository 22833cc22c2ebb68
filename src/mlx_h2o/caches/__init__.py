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


def make_cache(model, policy: str = "full", **options):
    """Per-layer caches for `model` under `policy` (see `POLICIES` for the names)."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {policy!r}")
    return POLICIES[policy](model, **options)


from . import baseline  # noqa: E402,F401  (registers "full" and "rotating")
