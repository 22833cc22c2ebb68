""""quantized": the full cache stored as MLX's packed affine 8- or 4-bit K/V, attended by the fused
kernel straight from the packed bytes.

mlx-lm's `QuantizedKVCache` already quantizes only the new tokens on append (no pass over the cache);
what it lacks on the CPU is a fast attention: its two `quantized_matmul`s and materialised score
matrix are slower than dense attention. `FusedQuantizedKVCache` keeps its storage and protocol and
adds `attend`.
"""

from mlx_lm.models import cache as lm_cache

from .. import hook
from ..options import Choice, Option, Policy
from . import per_layer_caches, register_policy
from .base import AttendingCache

GROUP_SIZES = (32, 64, 128)


class FusedQuantizedKVCache(AttendingCache, lm_cache.QuantizedKVCache):
    """mlx-lm's QuantizedKVCache, attended by the fused kernel on CPU streams."""

    def attend(self, queries, keys, values, *, scale, mask=None, sinks=None):
        # The packed-K/V kernel on CPU streams; on GPU mlx-lm's quantized_matmul path, the fast one there.
        return hook.fused_attention(queries, keys, values, self, scale, mask, sinks)

    @property
    def nbytes(self):
        """Bytes of the stored tokens (mlx-lm counts the whole step-allocated buffer)."""
        if self.keys is None:
            return 0
        k, v = self.keys_and_values()
        return sum(x.nbytes for x in (*k, *v))

    def _payload(self):
        return None if self.keys is None else self.keys_and_values()

    def _meta(self):
        return {"offset": self.offset, "bits": self.bits, "group_size": self.group_size}

    def _restore(self, payload, meta):
        self.__init__(group_size=meta["group_size"], bits=meta["bits"])
        if payload is not None:
            self.keys, self.values = (tuple(x) for x in payload)
        self.offset = meta["offset"]


register_policy(
    Policy(
        "quantized",
        "every token, packed at 8 or 4 bits (mlx-lm's QuantizedKVCache storage), attended from the packed bytes",
        (
            Option("bits", Choice((8, 4)), 8, "bits per stored K/V value"),
            Option("group_size", Choice(GROUP_SIZES), 64, "values sharing one scale and bias"),
        ),
        lambda model, bits, group_size: per_layer_caches(model, lambda i: FusedQuantizedKVCache(group_size=group_size, bits=bits)),
        (FusedQuantizedKVCache,),
    )
)
