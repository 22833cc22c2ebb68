"""The baselines every policy is measured against: mlx-lm's own caches.

"full": the model's default cache (`KVCache`, or whatever the model's `make_cache` builds).
"rotating": `RotatingKVCache(max_kv_size, keep=4)`, the StreamingLLM-style sink + sliding window.
"""

from mlx_lm.models import cache as lm_cache

from . import per_layer_caches, register_policy


def check_max_kv_size(max_kv_size) -> int:
    if isinstance(max_kv_size, bool) or not isinstance(max_kv_size, int) or max_kv_size < 1:
        raise ValueError(f"max_kv_size must be an integer >= 1, got {max_kv_size!r}")
    return max_kv_size


def reject_options(policy, options):
    if options:
        raise ValueError(f"policy {policy!r} takes no options {sorted(options)}")


@register_policy("full")
def full_cache(model, **options):
    reject_options("full", options)
    return lm_cache.make_prompt_cache(model)


@register_policy("rotating")
def rotating_cache(model, max_kv_size=None, keep: int = 4, **options):
    reject_options("rotating", options)
    max_kv_size = check_max_kv_size(max_kv_size)
    if not 0 <= keep < max_kv_size:
        raise ValueError(f"keep must be in [0, max_kv_size) = [0, {max_kv_size}), got {keep!r}")
    return per_layer_caches(model, lambda: lm_cache.RotatingKVCache(max_size=max_kv_size, keep=keep))
