""""rotated": rotate-then-quantize low-bit KV (shared/seeds/int4-kv-srft: random-sign Hadamard or
real-DFT rotation, per-coordinate λ, per-group scales) with a full-precision window of recent tokens.

Keys and values are stored as λ ⊙ (x Rᵀ) (see rotation.py): rows older than the `residual` most
recent tokens are packed at `bits` bits the moment they leave the window (only those rows are
quantized), the window stays in the model's dtype. Attention never un-rotates the cache: the query
is rotated instead, the fused kernel reads the packed rows and the window as two segments of one
call, and only the (B, Hq, L, D) output is rotated back.
"""

import itertools
from typing import Optional

import mlx.core as mx
from mlx_lm.models import cache as lm_cache
from mlx_lm.models.cache import create_attention_mask

from ..attention import attention_with_scores
from . import per_layer_caches, register_cache_class, register_policy
from .baseline import reject_options
from .packed import PackedRows
from .quantized import check_bits_and_group
from .rotation import DEFAULT_LAMBDA, LAMBDA_MODES, KVRotation

ROTATED_BITS = (2, 3, 4, 8)


@register_cache_class
class RotatedQuantizedKVCache(lm_cache._BaseCache):
    def __init__(self, bits: int = 4, group_size: int = 32, residual: int = 16, seed: int = 0, lam=DEFAULT_LAMBDA):
        check_bits_and_group(bits, group_size, ROTATED_BITS)
        lam = "none" if lam is None else lam  # eval specs spell it lam=none, which parses to None
        if isinstance(residual, bool) or not isinstance(residual, int) or residual < 0:
            raise ValueError(f"residual must be an integer >= 0, got {residual!r}")
        if not (lam in LAMBDA_MODES or isinstance(lam, tuple)):
            raise ValueError(f"lam must be one of {LAMBDA_MODES} or a calibrated (lam_k, lam_v) pair, got {lam!r}")
        self.bits, self.group_size, self.residual, self.seed, self.lam = bits, group_size, residual, seed, lam
        self.rotation: Optional[KVRotation] = None
        self.packed_k, self.packed_v = PackedRows(bits, group_size), PackedRows(bits, group_size)
        self.window_k = self.window_v = None  # (B, Hkv, <= residual, D) in the stored space
        self.offset = 0

    def _start(self, keys, values):
        self.rotation = KVRotation.seeded(keys.shape[-1], values.shape[-1], self.seed)
        if isinstance(self.lam, tuple):
            self.rotation.lam_k, self.rotation.lam_v = self.lam
        elif self.lam == "prefill":
            self.rotation.fit_lambdas(keys, values)

    def update_and_fetch(self, keys, values):
        if self.rotation is None:
            self._start(keys, values)
        k, v = self.rotation.keys(keys), self.rotation.values(values)
        if self.window_k is not None:
            k = mx.concatenate([self.window_k, k], axis=2)
            v = mx.concatenate([self.window_v, v], axis=2)
        overflow = k.shape[2] - self.residual
        if overflow > 0:  # rows leaving the window are packed now, and only they
            self.packed_k.append(k[:, :, :overflow])
            self.packed_v.append(v[:, :, :overflow])
            k, v = k[:, :, overflow:], v[:, :, overflow:]
        self.window_k, self.window_v = (k, v) if k.shape[2] else (None, None)
        self.offset += keys.shape[2]
        # Models pass (keys, values) on to attention untouched, where the hook hands them to attend.
        return self.segments(), None

    def segments(self):
        """[(k, v)] segments in position order, as attention_with_scores takes them."""
        segs = []
        if self.packed_k.length:
            segs.append((self.packed_k.view(), self.packed_v.view()))
        if self.window_k is not None:
            segs.append((self.window_k, self.window_v))
        return segs

    def attend(self, queries, segments, _values, *, scale, mask, sinks=None):
        out, _ = attention_with_scores(self.rotation.queries(queries), segments, scale=scale, mask=mask, scores=None, sinks=sinks)
        return self.rotation.output(out, queries.dtype)

    def size(self):
        return self.offset

    def empty(self):
        return self.offset == 0

    def is_trimmable(self):
        return True

    def trim(self, n):
        n = min(self.offset, n)
        in_window = 0 if self.window_k is None else min(n, self.window_k.shape[2])
        if in_window:
            keep = self.window_k.shape[2] - in_window
            self.window_k, self.window_v = (self.window_k[:, :, :keep], self.window_v[:, :, :keep]) if keep else (None, None)
        self.packed_k.trim(n - in_window)
        self.packed_v.trim(n - in_window)
        self.offset -= n
        return n

    def make_mask(self, *args, **kwargs):
        return create_attention_mask(*args, offset=self.offset, **kwargs)

    @property
    def nbytes(self):
        window = 0 if self.window_k is None else self.window_k.nbytes + self.window_v.nbytes
        return self.packed_k.nbytes + self.packed_v.nbytes + window

    @property
    def state(self):
        return {
            "packed_k": self.packed_k.state,
            "packed_v": self.packed_v.state,
            "window_k": self.window_k,
            "window_v": self.window_v,
            "rotation": None if self.rotation is None else self.rotation.state,
            "config": [self.offset, self.bits, self.group_size, self.residual, self.seed],
        }

    @state.setter
    def state(self, s):
        self.offset, self.bits, self.group_size, self.residual, self.seed = s["config"]
        self.packed_k, self.packed_v = PackedRows.from_state(s["packed_k"]), PackedRows.from_state(s["packed_v"])
        self.window_k, self.window_v = s["window_k"], s["window_v"]
        self.rotation = None if s["rotation"] is None else KVRotation.from_state(s["rotation"])
        self.lam = DEFAULT_LAMBDA  # unused once the rotation (with its λ) is restored


@register_policy("rotated")
def rotated_cache(model, bits: int = 4, group_size: int = 32, residual: int = 16, seed: int = 0, lam=DEFAULT_LAMBDA, **options):
    """Per layer: rotation seeded by seed + layer index; lam "none" (default), "prefill" (λ from the
    first update), or a per-layer list of calibrated (lam_k, lam_v) pairs (see calibrate_lambdas)."""
    reject_options("rotated", options)
    calibrated = lam if isinstance(lam, list) else None
    RotatedQuantizedKVCache(bits, group_size, residual, seed, "prefill" if calibrated else lam)  # validates options
    from .. import hook

    hook.install()
    index = itertools.count()

    def layer_cache():
        i = next(index)
        return RotatedQuantizedKVCache(bits, group_size, residual, seed + i, calibrated[i] if calibrated else lam)

    return per_layer_caches(model, layer_cache)


def calibrate_lambdas(model, tokens, seed: int = 0):
    """Per-layer (lam_k, lam_v) from one forward pass over `tokens` (a short calibration text), for
    make_cache(model, "rotated", lam=...). Layer seeds follow the policy's (seed + layer index)."""
    index = itertools.count()
    caches = per_layer_caches(model, lambda: RotatedQuantizedKVCache(8, 32, 0, seed + next(index), "prefill"))
    mx.eval(model(mx.array(tokens)[None], cache=caches))
    return [(c.rotation.lam_k, c.rotation.lam_v) for c in caches if isinstance(c, RotatedQuantizedKVCache)]
