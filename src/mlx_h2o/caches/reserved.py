""""reserved": the full KV cache, stored in buffers reserved once for `max_context` tokens.

mlx-lm's `KVCache` grows in 256-token steps by allocating a bigger buffer and copying the old one
into it: every step boundary is a stall proportional to the cache size. Pre-allocating the
maximum avoids the copies but commits memory the conversation may never use. A reserved cache
takes the address space for `max_context` tokens up front, lets the OS commit pages as tokens are
written into them, and writes every token in place (see mlx_h2o.storage.reserved). Attention gets views of
the live prefix; `nbytes` counts the live tokens only. Going past `max_context` is a ValueError
raised before anything is written (the cache does not grow); `trim` and `reset` give the pages
past the kept tokens back to the OS (Linux).

    cache = mlx_h2o.make_cache(model, "reserved", max_context=16384)
"""

from mlx_lm.models import cache as lm_cache

from ..options import Int, Option, Policy
from ..storage import ReservedBuffer, check_capacity
from ..storage.reserved import MAX_POSITIONS
from . import per_layer_caches, register_policy
from .base import FusedAttention, SavedCache


class ReservedKVCache(FusedAttention, SavedCache):
    """A full (lossless) KV cache whose keys and values live in reserved buffers of
    `max_context` positions, written in place; it attends as the full cache does (FusedAttention)."""

    def __init__(self, max_context: int):
        self.max_context = check_capacity(max_context, "max_context")
        self._keys = ReservedBuffer(self.max_context)
        self._values = ReservedBuffer(self.max_context)

    @property
    def offset(self) -> int:
        return self._keys.length

    @property
    def keys(self):
        """The live keys (B, H, offset, D), a view of the reservation; None before the first update."""
        return self._keys.view()

    @property
    def values(self):
        return self._values.view()

    def update_and_fetch(self, keys, values):
        for name, x in (("keys", keys), ("values", values)):
            if getattr(x, "ndim", None) != 4:
                raise ValueError(f"{name} must be an mx.array of shape (B, H, L, D), got {getattr(x, 'shape', type(x))}")
        if keys.shape[:3] != values.shape[:3]:
            raise ValueError(f"keys and values must agree on (B, H, L), got {tuple(keys.shape)} and {tuple(values.shape)}")
        # Checked here, before either buffer is written, so an overflow leaves the cache as it was.
        if self.offset + keys.shape[2] > self.max_context:
            raise ValueError(
                f"the cache is full: {self.offset} tokens + {keys.shape[2]} new > max_context={self.max_context}; "
                "make the cache with a larger max_context"
            )
        self._keys.write(self._keys.length, keys)
        self._values.write(self._values.length, values)
        return self.keys, self.values

    # The rest of KVCache's protocol reads only `offset`, `keys` and `values`, which mean the same
    # here (live views), so it is reused as is: nbytes counts live tokens, not the reservation.
    size = lm_cache.KVCache.size
    make_mask = lm_cache.KVCache.make_mask
    to_quantized = lm_cache.KVCache.to_quantized
    nbytes = lm_cache.KVCache.nbytes
    # Batched generation merges per-sequence caches into mlx-lm's BatchKVCache (a copy).
    merge = lm_cache.KVCache.merge

    def empty(self):
        # No tokens (KVCache asks whether keys exist; here they are a view of the reservation,
        # which outlives reset()).
        return self.offset == 0

    @property
    def reserved_nbytes(self) -> int:
        """Address space reserved for keys and values (committed only where written)."""
        return self._keys.reserved_nbytes + self._values.reserved_nbytes

    def _payload(self):
        # The live tokens only, so a saved prompt cache holds no reservation slack.
        return None if self.keys is None else (self.keys, self.values)

    def _meta(self):
        return {"max_context": self.max_context}

    def _restore(self, payload, meta):
        self.__init__(meta["max_context"])
        if payload is not None:
            self.update_and_fetch(*payload)

    def is_trimmable(self):
        return True

    def trim(self, n):
        n = min(self.offset, n)
        self._truncate(self.offset - n)
        return n

    def reset(self):
        """Forget every token (keeping the reservation) and give its pages back to the OS."""
        self._truncate(0)

    def _truncate(self, length: int):
        self._keys.truncate(length)
        self._values.truncate(length)


def _reserved(model, max_context):
    if max_context is None:
        max_context = getattr(getattr(model, "args", None), "max_position_embeddings", None)
        if max_context is None:
            raise ValueError("policy 'reserved' needs max_context (the model does not say its context length)")
    max_context = check_capacity(max_context, "max_context")
    return per_layer_caches(model, lambda i: ReservedKVCache(max_context))


register_policy(
    Policy(
        "reserved",
        "every token, in buffers reserved once for max_context tokens that commit memory only as tokens are written",
        (Option("max_context", Int(1, MAX_POSITIONS), None, "tokens reserved (unset: the model's context length)"),),
        _reserved,
        (ReservedKVCache,),
    )
)
