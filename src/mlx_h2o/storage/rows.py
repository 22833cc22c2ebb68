"""Rows of K or V in (B, H, capacity, ...) buffers: written a few at a time, compacted by one gather
that keeps chosen rows per (batch, head), read in place by the fused kernel."""

from typing import List, Optional, Sequence, Tuple

import mlx.core as mx

from .._native import _ext
from ..attention import DenseRows, PackedKV

GROW_STEP = 256  # rows added when a buffer grows without a stated capacity (as mlx-lm's caches do)
# Packed formats whose new rows one primitive centres, rotates, quantizes and writes (_ext.quantize_rows_into):
# MLX packs these bits into whole uint32 words.
FUSED_WRITE_BITS = (2, 4, 8)


def grown_capacity(needed: int) -> int:
    return -(-needed // GROW_STEP) * GROW_STEP


def check_group_size(option: str, group_size: int, head_dim: int) -> None:
    """Packed rows quantize whole groups of a row: `group_size` (the option named `option`) must
    divide the head dimension."""
    if head_dim % group_size:
        raise ValueError(
            f"{option}={group_size} does not divide the head dimension {head_dim}; use a group size that divides it, "
            "or unpacked storage"
        )


def pad_indices(idx: mx.array, capacity: int) -> mx.array:
    """idx (B, H, keep) padded with zeros to `capacity` columns: a gather with it leaves spare slots
    (copies of row 0 until overwritten; nothing reads past the live length)."""
    keep = idx.shape[2]
    if capacity <= keep:
        return idx
    return mx.concatenate([idx, mx.zeros((*idx.shape[:2], capacity - keep), idx.dtype)], axis=2)


def capacity_for(needed: int, capacity: Optional[int]) -> int:
    """Rows a buffer that must hold `needed` grows to: the stated `capacity` (at least `needed`), or
    the next GROW_STEP multiple."""
    return grown_capacity(needed) if capacity is None else max(capacity, needed)


def flat_rows(idx: mx.array, C: int) -> mx.array:
    """Row indices idx (B, H, k) into (B, H, C) buffers as indices into their B * H * C flattened rows."""
    B, H = idx.shape[:2]
    return (idx + (mx.arange(B * H, dtype=idx.dtype) * C).reshape(B, H, 1)).reshape(-1)


def grow_rows(arrays, length: int, capacity: int) -> tuple:
    """(B, H, C, ...) buffers keeping their first `length` rows, with room for `capacity`."""
    return tuple(mx.concatenate([a[:, :, :length], mx.zeros((*a.shape[:2], capacity - length, *a.shape[3:]), a.dtype)], axis=2)
                 for a in arrays)


def take_rows(arrays: Sequence[mx.array], idx: mx.array) -> List[mx.array]:
    """Rows idx (B, H, k) of each (B, H, C, ...) array per (batch, head), every index < C, in one
    primitive that copies whole rows (`_ext.take_rows`, csrc/take_rows.cpp). As stock ops each array
    was a `take` over its flattened rows after ~7 primitives for the flat index, and MLX's gather
    copies element by element: a compaction of SmolLM2's K, V and two columns at M = 512 was ~20
    primitives and ~100 µs, now one and a few µs."""
    if idx.dtype != mx.int32 and idx.dtype != mx.uint32:
        idx = idx.astype(mx.int32)
    return _ext.take_rows(list(arrays), idx)


class RowStore:
    """K or V rows in one format: dense (the model's dtype, `bits=None`) or MLX's packed affine
    format (`bits`, `group_size`), where writing quantizes only the new rows and a gather moves the
    packed words, scales and biases as they are (no dequantize / requantize)."""

    def __init__(self, bits: Optional[int] = None, group_size: int = 32):
        self.bits, self.group_size = bits, group_size
        self.arrays: Optional[Tuple[mx.array, ...]] = None  # dense: (x,); packed: (packed, scales, biases)

    @property
    def arrays(self) -> Optional[Tuple[mx.array, ...]]:
        return self._arrays

    @arrays.setter
    def arrays(self, arrays: Optional[Tuple[mx.array, ...]]) -> None:
        # every change of the buffers goes through here (or write(), which mutates them): the views
        # read before are of the old buffers
        self._arrays, self._view = arrays, None

    # -- format --------------------------------------------------------------------------------
    def encode(self, x: mx.array) -> Tuple[mx.array, ...]:
        if self.bits is None:
            return (x,)
        check_group_size("group_size", self.group_size, x.shape[-1])
        return tuple(mx.quantize(x, group_size=self.group_size, bits=self.bits))

    def decode(self, start: int, stop: int, dtype) -> mx.array:
        """Rows [start, stop) as dense values (for converting between tiers)."""
        rows = [a[:, :, start:stop] for a in self.arrays]
        if self.bits is None:
            return rows[0].astype(dtype)
        return mx.dequantize(*rows, group_size=self.group_size, bits=self.bits).astype(dtype)

    @property
    def dtype(self):
        """The dtype of the values stored (a packed store: its scales')."""
        return None if self.arrays is None else self.arrays[0 if self.bits is None else 1].dtype

    # -- buffer ---------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return 0 if self._arrays is None else self._arrays[0].shape[2]

    def reserve(self, like: Tuple[mx.array, ...], length: int, capacity: int) -> None:
        """Make room for `capacity` rows, keeping the first `length`; `like` gives shapes and dtypes."""
        if self.arrays is None:
            self.arrays = tuple(mx.zeros((*a.shape[:2], capacity, *a.shape[3:]), a.dtype) for a in like)
        else:
            self.arrays = grow_rows(self.arrays, length, capacity)

    def write(self, start: int, rows: Tuple[mx.array, ...]) -> None:
        """Encoded rows (as `encode` returns them) at [start, start + n)."""
        where = (slice(None), slice(None), slice(start, start + rows[0].shape[2]))
        self._view = None  # (the assignments below replace what the arrays hold)
        for a, r in zip(self._arrays, rows):
            a[where] = r

    def put(self, start: int, x: mx.array, rotation: Optional[mx.array] = None, center: Optional[mx.array] = None) -> None:
        """Dense rows x (B, H, n, D) at [start, start + n), first less `center` (a float32 (B, H, 1, D)
        array, the result rounded to x's dtype) and then rotated (x @ `rotation`, a float32 (D, D)
        matrix, summed in float64 and rounded once to x's dtype) when given. Packed at 2, 4 or 8 bits
        this is one primitive, or one per buffer for large buffers (`_ext.quantize_rows_into`, in
        place); as stock ops it was up to 10 (the centre's cast, subtraction and cast back, the
        matmul's flatten, matmul and unflatten, the quantize, a slice_update per array) for a decode
        step's one row."""
        if self.bits in FUSED_WRITE_BITS and x.dtype == self._arrays[1].dtype:
            self.arrays = tuple(_ext.quantize_rows_into(*self.arrays, x, start, rotation, self.bits, self.group_size, center))
            return
        if center is not None:
            x = (x - center).astype(x.dtype)
        if rotation is not None:
            x = _ext.rotate_rows(x, rotation, x.dtype)
        self.write(start, self.encode(x))

    def write_at(self, idx: mx.array, rows: mx.array) -> None:
        """Overwrite rows idx (B, H, n) with dense `rows` (B, H, n, ...), encoded in this format."""
        B, H, C = self.arrays[0].shape[:3]
        flat = flat_rows(idx, C)
        enc = self.encode(rows.astype(self.dtype))
        out = []
        for a, r in zip(self.arrays, enc):
            f = a.reshape(B * H * C, *a.shape[3:])
            f[flat] = r.reshape(-1, *r.shape[3:])
            out.append(f.reshape(a.shape))
        self.arrays = tuple(out)

    def drop_front(self, n: int, length: int) -> None:
        """Forget rows [0, n) of the first `length`, keeping exactly the rest (no spare room)."""
        self.arrays = tuple(a[:, :, n:length] for a in self.arrays)

    def view(self, n: int):
        """The first n rows as the fused kernel reads them, in place: a slice of a dense buffer, or a
        PackedKV of the whole packed buffers that reads n rows (no slices: a store's newest rows
        change at every decode step, and three slices per K and per V were 180 primitives of a
        30-layer model's step). The same object until the buffers change: a store's older rows (a
        tiered cache's low tier, a shared prefix) are read at every decode step and rewritten only
        when a compaction or a demotion comes."""
        if self._view is None or self._view[0] != n:
            if self.bits is None:
                view = self._arrays[0][:, :, :n]
            else:
                view = PackedKV(*self._arrays, self.bits, self.group_size, n)
            self._view = (n, view)
        return self._view[1]

    def in_place(self, n: int):
        """The first n rows as attention reads them without a slice: DenseRows of a dense buffer, the
        packed view of packed ones."""
        return self.view(n) if self.bits is not None else DenseRows(self._arrays[0], n)

    def nbytes(self, n: int) -> int:
        return 0 if self.arrays is None else sum(a[:, :, :n].nbytes for a in self.arrays)

    def state(self, n: int) -> List[mx.array]:
        return [a[:, :, :n] for a in self.arrays]

    def exact(self, n: int) -> List[mx.array]:
        """The first n rows in arrays of their own size: views when the buffers hold exactly n, else
        copies (a view would keep the whole buffer, spare room included)."""
        if self.capacity == n:
            return self.state(n)
        return [mx.contiguous(a[:, :, :n]) for a in self.arrays]

    def load(self, arrays: Sequence[mx.array]) -> None:
        self.arrays = tuple(arrays)
