"""Rotate-then-quantize for KV storage: a fixed random orthogonal rotation per layer, an optional
per-coordinate scale λ, and the query/output transforms that let attention run in the stored space.
`RotatedKV` wraps any K/V storage with it: keys/values are rotated on write, queries on the way into
attention, outputs on the way back.

Rotation R = B · diag(s) with s random ±1 signs (seeded) and B an orthonormal basis that mixes every
coordinate: the normalised Walsh-Hadamard matrix when the head dim is a power of two, otherwise the
orthonormal real DFT (cos/sin rows; the "SRFT" choice of shared/seeds/int4-kv-srft, defined for any
size and fully mixing, where a block-Hadamard would only mix within blocks). R is kept as a dense
D x D matrix and applied by matmul: exact for every D, inverse = transpose. (MLX's
`hadamard_transform` is not used: it is not self-inverse for sizes with a factor 20 and returns wrong
values for unsupported sizes such as 72.)

Stored keys are  k~ = λk ⊙ (k Rᵀ);  queries become  q~ = (q Rᵀ) / λk,  so  ⟨q~, k~⟩ = ⟨q, k⟩.
Stored values are v~ = λv ⊙ (v Rᵀ);  the attention output o~ = Σ p v~  maps back as  o = (o~ / λv) R.
λ (per kv head and coordinate) is 1 / max |rotated value| over the prefill (or a calibration text),
so every coordinate spans the same range before per-group quantization.
"""

from typing import Optional, Tuple, Union

import mlx.core as mx
import numpy as np

from .._native import _ext
from .kv import KVStorage, RowTransform
from .wrapper import KVWrapper

LAMBDA_FLOOR = 1e-6
# How a cache gets its per-coordinate λ: "none" (rotation alone) or "prefill" (fitted on the first
# update). "none" is the default: on SmolLM2 a prefill λ doubled rotated 4-bit's ΔPPL (+1.86 % vs
# +0.92 %, docs/storage.md) since the rotation already evens the coordinates out.
LAMBDA_MODES = ("none", "prefill")
DEFAULT_LAMBDA = "none"
# A layer's calibrated λ: (lam_k, lam_v), each (Hkv, D) (see caches.rotated.calibrate_lambdas).
Lambdas = Tuple[mx.array, mx.array]


def orthonormal_basis(dim: int) -> np.ndarray:
    """Walsh-Hadamard (power-of-two dim) or real DFT (other dims), rows orthonormal, float64."""
    if dim < 1:
        raise ValueError(f"head dim must be >= 1, got {dim}")
    if dim & (dim - 1) == 0:
        h = np.ones((1, 1))
        while h.shape[0] < dim:
            h = np.block([[h, h], [h, -h]])
        return h / np.sqrt(dim)
    n = np.arange(dim)
    rows = [np.full(dim, 1.0 / np.sqrt(dim))]
    for k in range(1, (dim - 1) // 2 + 1):
        rows.append(np.sqrt(2.0 / dim) * np.cos(2 * np.pi * k * n / dim))
        rows.append(np.sqrt(2.0 / dim) * np.sin(2 * np.pi * k * n / dim))
    if dim % 2 == 0:
        rows.append((-1.0) ** n / np.sqrt(dim))
    return np.stack(rows)


def random_signs(dim: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).choice(np.array([-1.0, 1.0]), size=dim)


class KVRotation:
    """The per-layer transform of rotated caches. `signs_k` (Dk,), `signs_v` (Dv,) fix the rotations;
    `lam_k`, `lam_v` (Hkv, D) or None (no per-coordinate scale)."""

    def __init__(self, signs_k: mx.array, signs_v: mx.array, lam_k: Optional[mx.array] = None, lam_v: Optional[mx.array] = None):
        self.signs_k, self.signs_v = signs_k, signs_v
        self.rk, self.rk_t = self._matrices(signs_k)
        self.rv, self.rv_t = self._matrices(signs_v)
        self.lam_k, self.lam_v = lam_k, lam_v

    @staticmethod
    def _matrices(signs):
        r = orthonormal_basis(signs.shape[0]) * np.array(signs.astype(mx.float32), dtype=np.float64)[None, :]
        # R, Rᵀ (x @ Rᵀ = x rotated), row-major: mx.array keeps a NumPy array's strides, and a transposed
        # matrix would be copied by every packed write that reads it (_ext.quantize_rows_into)
        return mx.array(np.ascontiguousarray(r, np.float32)), mx.array(np.ascontiguousarray(r.T, np.float32))

    @classmethod
    def seeded(cls, dk: int, dv: int, seed: int) -> "KVRotation":
        return cls(mx.array(random_signs(dk, seed).astype(np.float32)), mx.array(random_signs(dv, seed + 7919).astype(np.float32)))

    # -- λ ------------------------------------------------------------------------------------
    def fit_lambdas(self, keys: mx.array, values: mx.array) -> None:
        """λ = 1 / max |rotated coordinate| per kv head, over every token (and batch) given."""
        self.lam_k = self._fit(keys, self.rk_t)
        self.lam_v = self._fit(values, self.rv_t)

    @staticmethod
    def _fit(x: mx.array, rt: mx.array) -> mx.array:
        peak = mx.abs(x.astype(mx.float32) @ rt).max(axis=(0, 2))  # (Hkv, D)
        return 1.0 / mx.maximum(peak, LAMBDA_FLOOR)

    @staticmethod
    def _per_head(lam: Optional[mx.array], heads: int) -> Optional[mx.array]:
        if lam is None:
            return None
        return mx.repeat(lam, heads // lam.shape[0], axis=0)[None, :, None, :]  # (1, H, 1, D)

    # -- the transforms ------------------------------------------------------------------------
    def keys(self, k: mx.array) -> mx.array:
        return self._store(k, self.rk_t, self.lam_k)

    def values(self, v: mx.array) -> mx.array:
        return self._store(v, self.rv_t, self.lam_v)

    # The rotations are `_ext.rotate_rows`: one primitive (a matmul of a decode step's few rows was
    # three), each output summed in float64 and rounded once, as the packed write rotates its rows.
    @staticmethod
    def _store(x: mx.array, rt, lam) -> mx.array:
        if lam is None:
            return _ext.rotate_rows(x, rt, x.dtype)
        return (_ext.rotate_rows(x, rt, mx.float32) * lam[None, :, None, :]).astype(x.dtype)

    def queries(self, q: mx.array) -> mx.array:
        """float32 q~ for (B, Hq, L, Dk) queries."""
        y = _ext.rotate_rows(q, self.rk_t, mx.float32)
        lam = self._per_head(self.lam_k, q.shape[1])
        return y if lam is None else y / lam

    def output(self, o: mx.array, dtype) -> mx.array:
        """Attention output computed on stored values -> the model's space, in `dtype`."""
        lam = self._per_head(self.lam_v, o.shape[1])
        if lam is not None:
            o = o.astype(mx.float32) / lam
        return _ext.rotate_rows(o, self.rv, dtype)

    @property
    def state(self):
        return {"signs_k": self.signs_k, "signs_v": self.signs_v, "lam_k": self.lam_k, "lam_v": self.lam_v}

    @classmethod
    def from_state(cls, state) -> "KVRotation":
        return cls(state["signs_k"], state["signs_v"], state["lam_k"], state["lam_v"])


class RotatedKV(KVWrapper):
    """Storage whose rows are kept rotated (see the module docstring): `inner` holds λ ⊙ (x Rᵀ); the
    rotation is made on the first write (seeded; λ as `lam` says: "none", "prefill" = fitted on
    that write, or calibrated (lam_k, lam_v))."""

    def __init__(self, inner: KVStorage, seed: int, lam: Union[str, Lambdas] = DEFAULT_LAMBDA):
        super().__init__(inner)
        self.seed, self.lam = seed, lam
        self.rotation: Optional[KVRotation] = None

    def append(self, keys, values, capacity=None, transform=None) -> None:
        if transform is not None:
            raise ValueError("RotatedKV transforms its rows itself; it takes no transform")
        if self.rotation is None:
            self.rotation = KVRotation.seeded(keys.shape[-1], values.shape[-1], self.seed)
            if isinstance(self.lam, tuple):
                self.rotation.lam_k, self.rotation.lam_v = self.lam
            elif self.lam == "prefill":
                self.rotation.fit_lambdas(keys, values)
        if self.rotation.lam_k is None and self.rotation.lam_v is None:
            # a plain rotation: the storage's write applies it (one primitive for packed rows)
            self.inner.append(keys, values, capacity, RowTransform(self.rotation.rk_t, self.rotation.rv_t))
        else:
            self.inner.append(self.rotation.keys(keys), self.rotation.values(values), capacity)

    def fetch(self):
        return self.segments(), None  # rotated rows are not the model's keys

    def prepare_queries(self, queries):
        return self.rotation.queries(queries)

    def restore_output(self, out, dtype):
        return self.rotation.output(out, dtype)

    def rotations(self):
        r = self.rotation
        if r is None or r.lam_k is not None or r.lam_v is not None:  # (λ: queries() and output() scale too)
            return None
        return r.rk_t, r.rv  # what queries() and output() multiply by

    def state(self):
        return {"rows": self.inner.state(), "rotation": None if self.rotation is None else self.rotation.state}

    def load(self, state) -> None:
        self.inner.load(state["rows"])
        self.rotation = None if state["rotation"] is None else KVRotation.from_state(state["rotation"])


class CenteredKeysKV(KVWrapper):
    """Keys stored less their mean key c (per batch row and kv head), fixed once `after` rows have
    come. A shift common to every key moves each query's logits by the same q . c, which softmax
    ignores, while packed rows no longer spend their range on c: SmolLM2's post-RoPE keys share a
    mean of 0.6-0.8 of their norm, and rotated 4-bit rows err 7.2 % of a key's norm instead of 8.7 %
    with c from the first 128 rows (benchmarks/bench_key_centering.py). The first `skip` rows (the
    attention sinks, far from the mean, which then round worse: keep them finer, SinkRowsKV) are
    left out of c. Rows held when c is fixed are read back and written again centred, so c should
    come while they are still in a fine format (the high tier of a TieredKV).

    It sits below a RotatedKV (storage/h2o's Storage.make): it sees the keys in the model's space
    with the rotation the write applies (or, with a λ scale, already in the stored space). A model
    with learned attention sinks (a logit of their own, not shifted) needs q . c added back:
    key_center()."""

    def __init__(self, inner: KVStorage, after: int, skip: int = 0):
        super().__init__(inner)
        self.after, self.skip = after, skip
        # c (B, H, 1, Dk) float32 in the model's space, and as stored (rotated, if the writes rotate)
        self.center: Optional[mx.array] = None
        self.stored_center: Optional[mx.array] = None

    def append(self, keys, values, capacity=None, transform=None) -> None:
        transform = transform or RowTransform()
        if self.center is None:
            if self.inner.length + keys.shape[2] <= self.after:
                return self.inner.append(keys, values, capacity, transform)
            keys, values = self._fix_center(keys, values, transform)
            capacity = None if capacity is None else max(capacity, keys.shape[2])
        # the write subtracts c (one primitive with the rest of it for packed rows)
        self.inner.append(keys, values, capacity, transform._replace(key_center=self.center))

    def _fix_center(self, keys, values, transform: RowTransform):
        """Fix c from the rows held and `keys`; returns every row (held, then new) to write again."""
        held = self.inner.length
        if held:
            hk, hv = self.inner.read_rows()  # stored space, float32
            if transform.rk is not None:  # back to the model's space (stored = x @ r_t, r orthonormal)
                hk, hv = hk @ transform.rk.T, hv @ transform.rv.T
            self.inner.trim(held)
            keys = mx.concatenate([hk.astype(keys.dtype), keys], axis=2)
            values = mx.concatenate([hv.astype(values.dtype), values], axis=2)
        skip = min(self.skip, keys.shape[2] - 1)
        self.center = keys[:, :, skip:].astype(mx.float32).mean(axis=2, keepdims=True)
        self.stored_center = self.center if transform.rk is None else self.center @ transform.rk
        return keys, values

    def key_center(self, stored: bool = False) -> Optional[mx.array]:
        return self.stored_center if stored else self.center

    def read_rows(self):
        k, v = self.inner.read_rows()
        return (k, v) if self.center is None else (k + self.stored_center, v)

    def write_rows(self, idx, keys, values) -> None:
        self.inner.write_rows(idx, keys if self.center is None else keys - self.stored_center, values)

    def nbytes(self) -> int:
        return self.inner.nbytes() + (0 if self.center is None else 2 * self.center.nbytes)  # (both spaces)

    def state(self):
        return {"rows": self.inner.state(), "center": self.center, "stored_center": self.stored_center}

    def load(self, state) -> None:
        self.inner.load(state["rows"])
        self.center, self.stored_center = state["center"], state["stored_center"]
