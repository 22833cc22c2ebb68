"""mlx-h2o's KV cache policies as mlx-lm cache-policy plugins.

The patched mlx-lm (patches/mlx-lm, built by scripts/build_wheels.sh) finds cache policies through
the `mlx_lm.cache_policies` entry-point group; pyproject.toml names one attribute of this module per
policy, so every mlx-lm command runs them:

    mlx_lm.generate --model DIR --kv-policy h2o --kv-option max_kv_size=512 --prompt "..."
    mlx_lm.server --model DIR --kv-policy h2o --kv-option max_kv_size=512

Each attribute is a `PluginPolicy`: mlx-lm's plugin protocol (`name`, `summary`, `options`,
`parse_options`, `make`, `cache_classes`) over `mlx_h2o.caches.POLICIES[name]`. mlx-lm builds in
`full` and `rotating`. `rotating` is the same cache as ours, so it is not registered (a name defined
twice is an error in mlx-lm). `full` replaces mlx-lm's (`replaces_builtin`, patch 0009): the same
caches, every token, whose batches hold a prefix that forked requests share once (mlx-lm's
BatchKVCache holds it once per request; caches/baseline.py). Without a policy mlx-lm keeps its own
default caches. With stock mlx-lm nothing reads these entry points, and mlx-h2o keeps working
through its hook.
"""

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from .caches import POLICIES

# Policies mlx-lm defines itself (models/cache_policies.py of the patched wheel), and which of them
# this package replaces.
MLX_LM_BUILTINS = ("full", "rotating")
REPLACED_BUILTINS = ("full",)


@dataclass(frozen=True)
class PluginOption:
    """An option as mlx-lm lists it: `type` parses the command-line text (its __name__ says what
    it accepts), `choices` the values a user can write."""

    name: str
    type: Callable[[str], Any]
    default: Any
    help: str
    choices: Optional[Sequence[Any]]

    @classmethod
    def of(cls, option):
        def parse(text: str):
            return option.parse(text)

        choices = tuple(option.kind.names()) if hasattr(option.kind, "names") else None
        # mlx-lm prints the type's name, then the choices: the kind's Markdown form without them
        parse.__name__ = "choice" if choices else option.kind.describe().replace("`", "").replace("\\|", "|")
        default = "required" if option.required else option.default
        return cls(option.name, parse, default, option.help, choices)


class PluginPolicy:
    """mlx-lm's cache-policy plugin protocol over an mlx-h2o `Policy` (options.py)."""

    def __init__(self, policy):
        self.policy = policy
        self.name, self.summary, self.cache_classes = policy.name, policy.summary, policy.cache_classes
        self.options = tuple(PluginOption.of(o) for o in policy.options)
        self.replaces_builtin = policy.name in REPLACED_BUILTINS

    def parse_options(self, items):
        return self.policy.parse_options(items)

    def make(self, model, **options):
        return self.policy.make(model, **options)


def registered_names():
    """The policies this module exports (pyproject.toml lists the same names)."""
    return sorted(n for n in POLICIES if n not in MLX_LM_BUILTINS or n in REPLACED_BUILTINS)


# One attribute per entry point of pyproject.toml's [project.entry-points."mlx_lm.cache_policies"].
full = PluginPolicy(POLICIES["full"])
h2o = PluginPolicy(POLICIES["h2o"])
quantized = PluginPolicy(POLICIES["quantized"])
reserved = PluginPolicy(POLICIES["reserved"])
rotated = PluginPolicy(POLICIES["rotated"])
