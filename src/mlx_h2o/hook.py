"""The one hook mlx-h2o needs inside mlx-lm: every mlx-lm model computes attention through
`mlx_lm.models.base.scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks)`.

With mlx-lm patched by this project (patches/mlx-lm), that function itself hands the call to
`cache.attend(...)` when the cache has one, and nothing needs swapping. With stock mlx-lm, models
import the function by name (`from .base import scaled_dot_product_attention`), so rebinding the
module attribute would miss them; instead the function object's code is swapped for a trampoline
into `_dispatch`, which reaches every model, imported before or after, and `remove()` restores it.

`_dispatch` routes:
  1. a cache with `attend` (caches.base.AttendingCache, and the "full" and "rotating" policies' mlx-lm
     caches, caches/baseline.py) -> `cache.attend`;
  2. opt-in (`use_fast_cpu_attention()`), on CPU streams -> the fused kernel for every other cache
     (mlx-lm's own caches made by other code, and its QuantizedKVCache through the packed-K/V kernel);
  3. otherwise -> mlx-lm's original code, unchanged.
Caches install the hook themselves (AttendingCache.__new__); nothing else needs to call `install`.
"""

import types
from typing import Optional

import mlx.core as mx
from mlx_lm.models import base as _base

from . import _ops
from .attention import quantized_scaled_dot_product_attention_with_scores, scaled_dot_product_attention_with_scores

_target = _base.scaled_dot_product_attention
_original_code = _target.__code__
# The fork's MLX (the attention ops, patches 0003-0005) runs its own SDPA on the fused CPU kernel
# (patch 0009, in every build of the series): fixed for the process, read on every layer's call.
_MLX_SDPA_IS_FUSED = _ops.mlx_has_ops()
# A callable copy of mlx-lm's original function, immune to the code swap.
_original = types.FunctionType(_original_code, _target.__globals__, "scaled_dot_product_attention", _target.__defaults__)
# None: the default (the policies' caches attend with the fused kernel, other caches with mlx-lm's
# attention); True: every cache on CPU streams; False: mlx-lm's attention wherever a cache lets it.
_fast_cpu_attention = None


def _trampoline(queries, keys, values, cache, scale, mask, sinks=None):
    return _mlx_h2o_dispatch(queries, keys, values, cache, scale, mask, sinks)  # noqa: F821 (lives in base's globals)


def _dispatch(queries, keys, values, cache, scale, mask, sinks=None):
    attend = getattr(cache, "attend", None)
    if attend is not None:
        return attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
    if _fast_cpu_attention is True:
        return fused_attention(queries, keys, values, cache, scale, mask, sinks)
    return _original(queries, keys, values, cache, scale, mask, sinks)


def fused_attention(queries, keys, values, cache, scale, mask, sinks=None):
    """The fused kernel as the attention of mlx-lm's dense caches, and of its QuantizedKVCache through
    the packed-K/V kernel, on CPU streams; mlx-lm's own attention elsewhere."""
    if mx.default_device() != mx.cpu:
        return mlx_lm_attention(queries, keys, values, cache, scale, mask, sinks)
    if hasattr(cache, "bits"):  # mlx-lm's QuantizedKVCache: keys / values are packed triples
        return quantized_scaled_dot_product_attention_with_scores(
            queries, keys, values, scale=scale, mask=mask, scores=None, sinks=sinks, bits=cache.bits, group_size=cache.group_size
        )[0]
    held = cache.held_rows(keys, values) if hasattr(cache, "held_rows") else None
    return fused_dense_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks, held=held)


def fused_dense_attention(queries, keys, values, *, scale, mask, sinks=None, held=None):
    """The fused kernel over dense K/V, without scores. The fork's MLX runs it as its own SDPA (patch
    0009, which every MLX with the attention ops has): one C++ call, where the op's Python wrapper
    cost the fork's `--kv-policy full` ~10 % of a batched decode step (docs/mlx-lm.md). Rows stored
    in another dtype than the queries (`kv_dtype`) go to the op, which reads them as they are: MLX's
    SDPA would first cast them to the queries' dtype, a copy of the cache per call.
    held: (K buffer, V buffer, rows) of which keys and values are the first `rows` rows (a cache's,
    `held_rows`): the op reads the buffers in place, so the slices of them stay out of the graph (two
    primitives a layer, each ~8 µs of a 2-core decode step: docs/cpu-decode.md)."""
    if _MLX_SDPA_IS_FUSED and keys.dtype == queries.dtype:
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
    k, v, rows = held if held is not None else (keys, values, None)
    return scaled_dot_product_attention_with_scores(queries, k, v, scale=scale, mask=mask, scores=None, sinks=sinks, rows=rows)[0]


class _AttendProbe:
    """A cache whose `attend` answers with itself: what a natively dispatching mlx-lm returns."""

    def attend(self, queries, keys, values, *, scale, mask=None, sinks=None):
        return self


def _probe_native_attend() -> bool:
    try:
        probe = _AttendProbe()
        return _original(None, None, None, probe, 1.0, None) is probe
    except Exception:  # stock mlx-lm: the placeholders reach mx.fast and fail there
        return False


# Whether the installed mlx-lm calls `cache.attend` itself (the patched wheel).
MLX_LM_CALLS_ATTEND = _probe_native_attend()


def mlx_lm_attention(queries, keys, values, cache, scale, mask, sinks=None):
    """mlx-lm's own attention for what `cache` returned (e.g. a GPU fallback inside `attend`). A cache
    with `attend` is handed on as only what mlx-lm's function reads of it, its quantization: the
    patched mlx-lm would call its `attend` again."""
    if hasattr(cache, "attend"):
        cache = types.SimpleNamespace(bits=cache.bits, group_size=cache.group_size) if hasattr(cache, "bits") else None
    return _original(queries, keys, values, cache, scale, mask, sinks)


def _swap() -> None:
    _target.__globals__["_mlx_h2o_dispatch"] = _dispatch
    _target.__code__ = _trampoline.__code__


def install() -> None:
    """Make mlx-lm's attention reach `cache.attend` (idempotent; a no-op where mlx-lm does itself)."""
    if not MLX_LM_CALLS_ATTEND:
        _swap()


def remove() -> None:
    """Restore mlx-lm's original attention function."""
    _target.__code__ = _original_code


def installed() -> bool:
    """Whether caches with `attend` get their attention calls."""
    return MLX_LM_CALLS_ATTEND or _target.__code__ is not _original_code


def use_fast_cpu_attention(enabled: Optional[bool] = True) -> None:
    """True: the fused CPU kernel as the attention of every mlx-lm model on CPU streams, whatever made
    its cache (dense caches, and mlx-lm's QuantizedKVCache). False: mlx-lm's own attention for
    mlx-lm's caches, the `full` and `rotating` policies' included (the `mlx-h2o` CLI's
    `--attention stock`). None: the default, the policies' caches on the fused kernel and others on
    mlx-lm's."""
    global _fast_cpu_attention
    if enabled is not None and not isinstance(enabled, bool):
        raise ValueError(f"enabled must be True, False or None, got {enabled!r}")
    _fast_cpu_attention = enabled
    if enabled:
        _swap()


def fast_cpu_attention_setting() -> Optional[bool]:
    """What use_fast_cpu_attention was last given (True, False, or None: the default)."""
    return _fast_cpu_attention


def fast_cpu_attention_enabled() -> bool:
    """Whether every mlx-lm cache on CPU streams attends with the fused kernel (the opt-in)."""
    return _fast_cpu_attention is True and _target.__code__ is not _original_code


def baseline_attention_fused() -> bool:
    """Whether the baseline policies' mlx-lm caches attend with the fused kernel (unless opted out)."""
    return _fast_cpu_attention is not False
