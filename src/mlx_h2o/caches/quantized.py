""""quantized": the full cache stored as MLX's packed affine 8- or 4-bit K/V, attended by the fused
kernel straight from the packed bytes.

mlx-lm's `QuantizedKVCache` already quantizes only the new tokens on append (no pass over the cache);
what it lacks on the CPU is a fast attention: its two `quantized_matmul`s and materialised score
matrix are slower than dense attention. `FusedQuantizedKVCache` keeps its storage and protocol and
adds `attend`, which the hook routes every mlx-lm model's attention to.
"""

import mlx.core as mx
from mlx_lm.models import cache as lm_cache

from ..attention import quantized_scaled_dot_product_attention_with_scores
from . import per_layer_caches, register_cache_class, register_policy
from .baseline import reject_options

KV_BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)


def check_bits_and_group(bits, group_size, allowed_bits=KV_BITS):
    if bits not in allowed_bits or isinstance(bits, bool):
        raise ValueError(f"bits must be one of {allowed_bits}, got {bits!r}")
    if group_size not in GROUP_SIZES or isinstance(group_size, bool):
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size!r}")


@register_cache_class
class FusedQuantizedKVCache(lm_cache.QuantizedKVCache):
    """mlx-lm's QuantizedKVCache, attended by the fused kernel on CPU streams."""

    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        if mx.default_device() != mx.cpu:  # GPU: mlx-lm's quantized_matmul path is the fast one there
            from ..hook import mlx_lm_attention

            return mlx_lm_attention(queries, keys, values, self, scale, mask, sinks)
        return quantized_scaled_dot_product_attention_with_scores(
            queries, keys, values, scale=scale, mask=mask, scores=None, sinks=sinks, bits=self.bits, group_size=self.group_size
        )[0]

    @property
    def nbytes(self):
        """Bytes of the stored tokens (mlx-lm counts the whole step-allocated buffer)."""
        if self.keys is None:
            return 0
        k, v = self.keys_and_values()
        return sum(x.nbytes for x in (*k, *v))


@register_policy("quantized")
def quantized_cache(model, bits: int = 8, group_size: int = 64, **options):
    reject_options("quantized", options)
    check_bits_and_group(bits, group_size)
    from .. import hook

    hook.install()
    return per_layer_caches(model, lambda: FusedQuantizedKVCache(group_size=group_size, bits=bits))
