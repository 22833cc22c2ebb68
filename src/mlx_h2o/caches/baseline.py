"""The baselines every policy is measured against: mlx-lm's own caches.

"full": the model's default cache (`KVCache`, or whatever the model's `make_cache` builds).
"rotating": `RotatingKVCache(max_kv_size, keep=4)`, the StreamingLLM-style sink + sliding window.

Both store K/V rows as `kv_dtype` says. Unset, that is float16 where the model computes in float32
(on the CPU, the GGUF models; `storage.default_kv_dtype`): half the cache, as llama.cpp's default f16
cache, and the fused kernel reads the float16 rows as they are (docs/cpu-decode.md has the
measurement). `kv_dtype=float32` keeps them as mlx-lm's own KVCache does.

Their `KVCache` / `RotatingKVCache` layers attend with the same fused CPU kernel as every other
policy (no opt-in, so that `full` and `h2o` differ by what they keep, not by the kernel): the
subclasses below add `attend` and nothing else. State and save format stay mlx-lm's; a saved cache
names the subclass, which load_prompt_cache finds once mlx-h2o is imported (or through the patched
mlx-lm's policy plugins).

Batched, the full cache holds a prefix its requests share once: `FusedKVCache.merge` makes a
`SharedRowsBatch` (caches/shared_rows.py), where mlx-lm's `BatchKVCache` copies it into each
request's row of one padded array.
"""

import copy

import mlx.core as mx
from mlx_lm.models import cache as lm_cache

from .. import hook
from ..options import REQUIRED, Choice, Int, Option, Policy
from ..storage import KV_DTYPE_HELP, KV_DTYPES, stored_as
from . import per_layer_caches, register_policy
from .base import FusedAttention, fetched_ids, handed_on
from .shared_rows import SharedRowsKVCache, rows_piece

MAX_KV_SIZE = Option("max_kv_size", Int(1), REQUIRED, "KV budget in tokens per layer")
KV_DTYPE = Option("kv_dtype", Choice(KV_DTYPES), None, KV_DTYPE_HELP)


class StoredDtype:
    """Mixin for an mlx-lm dense cache: rows are stored as `kv_dtype` (None: as they come). Once a
    cache holds rows, their dtype decides, so a cache loaded from a file (mlx-lm's from_state keeps
    no attributes) goes on in the dtype it was saved in instead of widening its buffer."""

    kv_dtype = None  # a name of an mx dtype

    def update_and_fetch(self, keys, values):
        return super().update_and_fetch(*stored_as(self.kept_dtype(keys.dtype), keys, values))

    def kept_dtype(self, dtype):
        """The dtype rows that arrive in `dtype` are stored in (the flat llama block has its kernel
        write them so, where a cast would be a primitive per array and step)."""
        if self.keys is not None:
            return self.keys.dtype
        return dtype if self.kv_dtype is None else getattr(mx, self.kv_dtype)


class FusedKVCache(FusedAttention, StoredDtype, lm_cache.KVCache):
    """mlx-lm's KVCache, attended by the fused CPU kernel; batched, its sequences hold a shared
    prefix once (SharedRowsBatch)."""

    merge = SharedRowsKVCache.merge
    # Learnt as SharedRowsKVCache learns it, for the copies a batch makes of this cache: those of a
    # snapshot that knows get their shared rows as they are from their first call.
    passes_rows, _fetched_id = None, None
    _shared = None  # shared_rows(), while the rows are unchanged

    def update_and_fetch(self, keys, values):
        self._shared = None
        fetched = super().update_and_fetch(keys, values)
        self._fetched_id = fetched_ids(fetched)
        return fetched

    def held_rows(self, keys, values):
        """(K buffer, V buffer, rows) where keys and values are what update_and_fetch returned: views of
        the buffers' first `offset` rows, which the fused kernel reads in place (hook.fused_attention).
        None for anything else."""
        if self.keys is None or not handed_on(self._fetched_id, keys, values):
            return None
        return self.keys, self.values, self.offset

    def trim(self, n):
        self._shared = None
        return super().trim(n)

    def shared_rows(self):
        """Its rows as one read-only store (views of its buffers) that it and its copies hand to a
        batch, which then holds them once (caches/shared_rows.py)."""
        if self._shared is None:
            self._shared = rows_piece(self)
        return self._shared

    def __deepcopy__(self, memo):
        # The copy's arrays are new MLX handles on the same buffers (writing one never changes the
        # other), and it shares this cache's read-only store of them.
        shared = self.shared_rows() if self.keys is not None and self.offset else None
        twin = type(self).__new__(type(self))
        memo[id(self)] = twin
        twin.__dict__.update({k: copy.deepcopy(v, memo) for k, v in self.__dict__.items() if k != "_shared"})
        twin._shared = shared
        return twin

    def attend(self, queries, keys, values, *, scale, mask=None, sinks=None):
        if self.passes_rows is None:
            self.passes_rows = handed_on(self._fetched_id, keys, values)
        return super().attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks)


class FusedRotatingKVCache(FusedAttention, StoredDtype, lm_cache.RotatingKVCache):
    """mlx-lm's RotatingKVCache, attended by the fused CPU kernel."""


FUSED_CLASSES = {lm_cache.KVCache: FusedKVCache, lm_cache.RotatingKVCache: FusedRotatingKVCache}


def with_fused_attention(cache, kv_dtype=None):
    """`cache` itself, switched to its fused subclass when it is a plain KVCache / RotatingKVCache
    (others, e.g. SSM state, stay as they are), storing rows as `kv_dtype` (None: as they come)."""
    fused = FUSED_CLASSES.get(type(cache))
    if fused is not None:
        hook.install()
        cache.__class__ = fused
        if kv_dtype is not None:
            cache.kv_dtype = kv_dtype
    return cache


def _full(model, kv_dtype=None):
    return [with_fused_attention(c, kv_dtype) for c in lm_cache.make_prompt_cache(model)]


def _rotating(model, max_kv_size, keep, kv_dtype=None):
    if keep >= max_kv_size:
        raise ValueError(f"keep must be in [0, max_kv_size) = [0, {max_kv_size}), got {keep!r}")
    return per_layer_caches(model, lambda i: with_fused_attention(lm_cache.RotatingKVCache(max_size=max_kv_size, keep=keep), kv_dtype))


register_policy(Policy("full", "every token (the model's own caches); batched, requests forked from one prompt cache share its rows",
                       (KV_DTYPE,), _full, cache_classes=(FusedKVCache, FusedRotatingKVCache, SharedRowsKVCache)))
register_policy(
    Policy(
        "rotating",
        "mlx-lm's RotatingKVCache: sink tokens + a sliding window (StreamingLLM)",
        (MAX_KV_SIZE, Option("keep", Int(0), 4, "first tokens always kept (attention sinks)"), KV_DTYPE),
        _rotating,
        cache_classes=(FusedRotatingKVCache,),
    )
)
