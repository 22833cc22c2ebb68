"""The one hook mlx-h2o needs inside mlx-lm: every mlx-lm model computes attention through
`mlx_lm.models.base.scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks)`.

Models import that function by name (`from .base import scaled_dot_product_attention`), so
rebinding the module attribute would miss them. Instead the function object's code is swapped for a
trampoline into `_dispatch`, which reaches every model, imported before or after, and `remove()`
restores the original code. `_dispatch` routes:
  1. a cache with an `attend(queries, keys, values, scale=, mask=, sinks=)` method (the H2O caches,
     which need the attention scores) -> that method;
  2. otherwise, if fast CPU attention is enabled and the stream is the CPU -> the fused kernel
     (dense caches, and mlx-lm's QuantizedKVCache through the packed-K/V kernel);
  3. otherwise -> mlx-lm's original code, unchanged.
"""

import types

import mlx.core as mx
from mlx_lm.models import base as _base

from .attention import quantized_scaled_dot_product_attention_with_scores, scaled_dot_product_attention_with_scores

_target = _base.scaled_dot_product_attention
_original_code = _target.__code__
# A callable copy of mlx-lm's original function, immune to the code swap.
_original = types.FunctionType(_original_code, _target.__globals__, "scaled_dot_product_attention", _target.__defaults__)
_fast_cpu_attention = False


def _trampoline(queries, keys, values, cache, scale, mask, sinks=None):
    return _mlx_h2o_dispatch(queries, keys, values, cache, scale, mask, sinks)  # noqa: F821 (lives in base's globals)


def _dispatch(queries, keys, values, cache, scale, mask, sinks=None):
    attend = getattr(cache, "attend", None)
    if attend is not None:
        return attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
    if _fast_cpu_attention and mx.default_device() == mx.cpu:
        if hasattr(cache, "bits"):  # mlx-lm's QuantizedKVCache: keys / values are packed triples
            return quantized_scaled_dot_product_attention_with_scores(
                queries, keys, values, scale=scale, mask=mask, scores=None, sinks=sinks, bits=cache.bits, group_size=cache.group_size
            )[0]
        return scaled_dot_product_attention_with_scores(queries, keys, values, scale=scale, mask=mask, scores=None, sinks=sinks)[0]
    return _original(queries, keys, values, cache, scale, mask, sinks)


def mlx_lm_attention(queries, keys, values, cache, scale, mask, sinks=None):
    """mlx-lm's own attention function, whatever the hook routes."""
    return _original(queries, keys, values, cache, scale, mask, sinks)


def install() -> None:
    """Route mlx-lm attention through `_dispatch` (idempotent). A no-op for caches without `attend`."""
    _target.__globals__["_mlx_h2o_dispatch"] = _dispatch
    _target.__code__ = _trampoline.__code__


def remove() -> None:
    """Restore mlx-lm's original attention function."""
    _target.__code__ = _original_code


def installed() -> bool:
    return _target.__code__ is not _original_code


def use_fast_cpu_attention(enabled: bool = True) -> None:
    """Opt in (or out) to the fused CPU kernel as the attention of every mlx-lm model on CPU streams
    (dense caches; mlx-lm's quantized caches keep their own path)."""
    global _fast_cpu_attention
    _fast_cpu_attention = bool(enabled)
    if enabled:
        install()


def fast_cpu_attention_enabled() -> bool:
    return _fast_cpu_attention and installed()
