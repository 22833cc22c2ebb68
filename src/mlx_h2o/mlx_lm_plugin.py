"""mlx-h2o's KV cache policies as mlx-lm cache-policy plugins.

The patched mlx-lm (patches/mlx-lm, built by scripts/build_wheels.sh) finds cache policies through
the `mlx_lm.cache_policies` entry-point group; pyproject.toml names one attribute of this module per
policy, so every mlx-lm command runs them:

    mlx_lm.generate --model DIR --kv-policy h2o --kv-option max_kv_size=512 --prompt "..."
    mlx_lm.server --model DIR --kv-policy h2o --kv-option max_kv_size=512

An entry point resolves to an object with what mlx-lm's plugin protocol asks for (`name`, `summary`,
`options`, `parse_options`, `make`, `cache_classes`): `mlx_h2o.caches.POLICIES[name]` itself.
mlx-lm builds in `full` and `rotating` (the same caches as ours), so those two are not registered:
a name defined twice is an error in mlx-lm.

With stock mlx-lm nothing reads these entry points, and mlx-h2o keeps working through its hook.
"""

import inspect

import mlx_h2o  # noqa: F401  (loads mlx.core before the extension the caches use)

from .caches import POLICIES

# Policies mlx-lm defines itself (models/cache_policies.py of the patched wheel).
MLX_LM_BUILTINS = ("full", "rotating")


class _BuilderPolicy:
    """STOPGAP while `mlx_h2o.caches.POLICIES` maps names to builder functions: the plugin protocol
    over a builder. Options are passed to the builder unchecked (which rejects unknown
    ones with the allowed list); KEY=VALUE strings become int, float, bool or str. Remove once every
    POLICIES value is a Policy (name, summary, options, parse_options, make, cache_classes)."""

    def __init__(self, name, builder):
        self.name, self._builder = name, builder
        self.cache_classes = _mlx_h2o_cache_classes()  # a superset: load_prompt_cache looks up by name
        self.summary = (inspect.getdoc(builder) or f"mlx-h2o's {name!r} cache").splitlines()[0]
        self.options = ()

    @staticmethod
    def _value(text: str):
        for parse in (int, float):
            try:
                return parse(text)
            except ValueError:
                pass
        return {"true": True, "false": False, "none": None}.get(text.lower(), text)

    def parse_options(self, items):
        return {k: self._value(v) for k, v in items.items()}

    def make(self, model, **options):
        return self._builder(model, **options)


def _mlx_h2o_cache_classes():
    from mlx_lm.models.cache import _BaseCache

    found, todo = set(), [_BaseCache]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            if sub.__module__.startswith("mlx_h2o."):
                found.add(sub)
    return tuple(sorted(found, key=lambda c: c.__name__))


def policy(name: str):
    """The plugin object of mlx-h2o's policy `name`."""
    p = POLICIES[name]
    return p if hasattr(p, "make") else _BuilderPolicy(name, p)


def registered_names():
    """The policies this module exports (pyproject.toml lists the same names)."""
    return sorted(n for n in POLICIES if n not in MLX_LM_BUILTINS)


# One attribute per entry point of pyproject.toml's [project.entry-points."mlx_lm.cache_policies"].
h2o = policy("h2o")
quantized = policy("quantized")
reserved = policy("reserved")
rotated = policy("rotated")
