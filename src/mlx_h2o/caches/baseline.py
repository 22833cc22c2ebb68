"""The baselines every policy is measured against: mlx-lm's own caches.

"full": the model's default cache (`KVCache`, or whatever the model's `make_cache` builds).
"rotating": `RotatingKVCache(max_kv_size, keep=4)`, the StreamingLLM-style sink + sliding window.
"""

from mlx_lm.models import cache as lm_cache

from ..options import REQUIRED, Int, Option, Policy
from . import per_layer_caches, register_policy

MAX_KV_SIZE = Option("max_kv_size", Int(1), REQUIRED, "KV budget in tokens per layer")


def _rotating(model, max_kv_size, keep):
    if keep >= max_kv_size:
        raise ValueError(f"keep must be in [0, max_kv_size) = [0, {max_kv_size}), got {keep!r}")
    return per_layer_caches(model, lambda i: lm_cache.RotatingKVCache(max_size=max_kv_size, keep=keep))


register_policy(Policy("full", "every token (the model's own cache)", (), lambda model: lm_cache.make_prompt_cache(model)))
register_policy(
    Policy(
        "rotating",
        "mlx-lm's RotatingKVCache: sink tokens + a sliding window (StreamingLLM)",
        (MAX_KV_SIZE, Option("keep", Int(0), 4, "first tokens always kept (attention sinks)")),
        _rotating,
    )
)
