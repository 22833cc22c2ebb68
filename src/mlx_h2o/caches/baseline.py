"""The baselines every policy is measured against: mlx-lm's own caches.

"full": the model's default cache (`KVCache`, or whatever the model's `make_cache` builds).
"rotating": `RotatingKVCache(max_kv_size, keep=4)`, the StreamingLLM-style sink + sliding window.

Their `KVCache` / `RotatingKVCache` layers attend with the same fused CPU kernel as every other
policy (no opt-in, so that `full` and `h2o` differ by what they keep, not by the kernel): the
subclasses below add `attend` and nothing else. State and save format stay mlx-lm's; a saved cache
names the subclass, which load_prompt_cache finds once mlx-h2o is imported (or through the patched
mlx-lm's policy plugins).
"""

from mlx_lm.models import cache as lm_cache

from .. import hook
from ..options import REQUIRED, Int, Option, Policy
from . import per_layer_caches, register_policy

MAX_KV_SIZE = Option("max_kv_size", Int(1), REQUIRED, "KV budget in tokens per layer")


class FusedAttention:
    """Mixin for an mlx-lm cache: its layer's attention by the fused kernel on CPU streams
    (`hook.fused_attention`), mlx-lm's own elsewhere or after `use_fast_cpu_attention(False)`."""

    def __new__(cls, *args, **kwargs):
        hook.install()  # the constructor, from_state (load_prompt_cache) and copies all pass here
        return super().__new__(cls)

    def attend(self, queries, keys, values, *, scale, mask=None, sinks=None):
        if not hook.baseline_attention_fused():
            return hook.mlx_lm_attention(queries, keys, values, self, scale, mask, sinks)
        return hook.fused_attention(queries, keys, values, self, scale, mask, sinks)  # mlx-lm's off the CPU


class FusedKVCache(FusedAttention, lm_cache.KVCache):
    """mlx-lm's KVCache, attended by the fused CPU kernel."""


class FusedRotatingKVCache(FusedAttention, lm_cache.RotatingKVCache):
    """mlx-lm's RotatingKVCache, attended by the fused CPU kernel."""


FUSED_CLASSES = {lm_cache.KVCache: FusedKVCache, lm_cache.RotatingKVCache: FusedRotatingKVCache}


def with_fused_attention(cache):
    """`cache` itself, switched to its fused subclass when it is a plain KVCache / RotatingKVCache
    (others, e.g. SSM state, stay as they are)."""
    fused = FUSED_CLASSES.get(type(cache))
    if fused is not None:
        hook.install()
        cache.__class__ = fused
    return cache


def _full(model):
    return [with_fused_attention(c) for c in lm_cache.make_prompt_cache(model)]


def _rotating(model, max_kv_size, keep):
    if keep >= max_kv_size:
        raise ValueError(f"keep must be in [0, max_kv_size) = [0, {max_kv_size}), got {keep!r}")
    return per_layer_caches(model, lambda i: FusedRotatingKVCache(max_size=max_kv_size, keep=keep))


register_policy(Policy("full", "every token (the model's own cache)", (), _full,
                       cache_classes=(FusedKVCache, FusedRotatingKVCache)))
register_policy(
    Policy(
        "rotating",
        "mlx-lm's RotatingKVCache: sink tokens + a sliding window (StreamingLLM)",
        (MAX_KV_SIZE, Option("keep", Int(0), 4, "first tokens always kept (attention sinks)")),
        _rotating,
        cache_classes=(FusedRotatingKVCache,),
    )
)
