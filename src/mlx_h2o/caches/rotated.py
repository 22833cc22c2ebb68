""""rotated": rotate-then-quantize low-bit KV (shared/seeds/int4-kv-srft: random-sign Hadamard or
real-DFT rotation, per-coordinate λ, per-group scales) with a full-precision window of recent tokens.

The storage is two tiers under a rotation (storage/): keys and values are stored as λ ⊙ (x Rᵀ),
rows older than the `residual` most recent tokens packed at `bits` bits the moment they leave the
window (only those rows are quantized), the window in the model's dtype. Attention never un-rotates
the cache: the query is rotated instead, the fused kernel reads the packed rows and the window as
two segments of one call, and only the (B, Hq, L, D) output is rotated back.
"""

import mlx.core as mx
from mlx_lm.models.cache import create_attention_mask

from ..attention import attention_with_scores
from ..options import Choice, Custom, Int, Option, Policy, check_choice
from ..storage import DEFAULT_LAMBDA, LAMBDA_MODES, RotatedKV, TieredKV, check_group_size
from . import per_layer_caches, register_policy
from .base import AttendingCache
from .quantized import GROUP_SIZES

ROTATED_BITS = (2, 3, 4, 8)


class RotatedQuantizedKVCache(AttendingCache):
    def __init__(self, bits: int = 4, group_size: int = 32, residual: int = 16, seed: int = 0, lam=DEFAULT_LAMBDA):
        self.bits, self.group_size, self.residual, self.seed, self.lam = bits, group_size, residual, seed, lam
        self.store = RotatedKV(TieredKV(bits, None, residual, group_size), seed, lam)
        self.offset = 0

    def update_and_fetch(self, keys, values):
        if self.offset == 0:
            for x in (keys, values):
                check_group_size("group_size", self.group_size, x.shape[-1])
        self.store.append(keys, values)
        self.offset += keys.shape[2]
        # Models pass what this returns on to attention untouched, where it reaches attend().
        return self.store.fetch()

    def attend(self, queries, segments, _values, *, scale, mask=None, sinks=None):
        rotations = self.store.rotations()  # the op rotates the queries and output itself, else the store
        q = queries if rotations else self.store.prepare_queries(queries)
        q_rotation, out_rotation = rotations or (None, None)
        out, _ = attention_with_scores(q, segments, scale=scale, mask=mask, scores=None, sinks=sinks,
                                       q_rotation=q_rotation, out_rotation=out_rotation)
        return out if rotations else self.store.restore_output(out, queries.dtype)

    @property
    def lambdas(self):
        """(lam_k, lam_v) of this layer's rotation (None before the first update or with lam="none")."""
        rotation = self.store.rotation
        return None if rotation is None else (rotation.lam_k, rotation.lam_v)

    def size(self):
        return self.offset

    def empty(self):
        return self.offset == 0

    def is_trimmable(self):
        return True

    def trim(self, n):
        n = min(self.offset, n)
        self.store.trim(n)
        self.offset -= n
        return n

    def make_mask(self, *args, **kwargs):
        return create_attention_mask(*args, offset=self.offset, **kwargs)

    @property
    def nbytes(self):
        return self.store.nbytes()

    def _payload(self):
        calibrated = list(self.lam) if isinstance(self.lam, tuple) else None
        return {"rows": self.store.state(), "lam": calibrated}

    def _meta(self):
        lam = self.lam if isinstance(self.lam, str) else "calibrated"
        return {"offset": self.offset, "bits": self.bits, "group_size": self.group_size, "residual": self.residual,
                "seed": self.seed, "lam": lam}

    def _restore(self, payload, meta):
        lam = tuple(payload["lam"]) if meta["lam"] == "calibrated" else meta["lam"]
        self.__init__(meta["bits"], meta["group_size"], meta["residual"], meta["seed"], lam)
        self.store.load(payload["rows"])
        self.offset = meta["offset"]


def _check_lam(name, value):
    if isinstance(value, list):
        if not all(isinstance(p, tuple) and len(p) == 2 and all(isinstance(a, mx.array) for a in p) for p in value):
            raise ValueError(f"{name} as a list must hold one calibrated (lam_k, lam_v) pair of mx.arrays per layer")
        return value
    return check_choice(name, value, LAMBDA_MODES, {None: "none"})


def _rotated(model, bits, group_size, residual, lam, seed):
    def layer_cache(i):
        if isinstance(lam, list) and i >= len(lam):
            raise ValueError(f"lam holds calibrated pairs for {len(lam)} layers; the model has more")
        return RotatedQuantizedKVCache(bits, group_size, residual, seed + i, lam[i] if isinstance(lam, list) else lam)

    return per_layer_caches(model, layer_cache)


register_policy(
    Policy(
        "rotated",
        "every token, rotated then packed at 2/3/4/8 bits, the newest in full precision",
        (
            Option("bits", Choice(ROTATED_BITS), 4, "bits per stored value"),
            Option("group_size", Choice(GROUP_SIZES), 32, "values sharing one scale and bias (must divide the head dim)"),
            Option("residual", Int(0), 16, "newest tokens kept in full precision"),
            Option("lam", Custom(_check_lam, lambda name, text: text, "`none` \\| `prefill` \\| calibrated pairs"),
                   DEFAULT_LAMBDA, "per-coordinate scale: none, fitted on the prefill, or calibrate_lambdas(model, tokens)"),
            Option("seed", Int(), 0, "seed of layer 0's rotation (layer i uses seed + i)"),
        ),
        _rotated,
        (RotatedQuantizedKVCache,),
    )
)


def calibrate_lambdas(model, tokens, seed: int = 0):
    """Per-layer (lam_k, lam_v) from one forward pass over `tokens` (a short calibration text), for
    make_cache(model, "rotated", lam=...). Layer seeds follow the policy's (seed + layer index)."""
    caches = per_layer_caches(model, lambda i: RotatedQuantizedKVCache(8, 32, 0, seed + i, "prefill"))
    mx.eval(model(mx.array(tokens)[None], cache=caches))
    return [c.lambdas for c in caches if isinstance(c, RotatedQuantizedKVCache)]
