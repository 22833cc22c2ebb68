"""Growable storage of MLX affine-packed K or V rows (packed uint32 words, scales, biases), written
a few tokens at a time (quantize-on-append: only the new rows are quantized) and read in place by
the fused kernel as a `PackedKV`."""

from typing import Optional, Tuple

import mlx.core as mx

from ..attention import PackedKV


class PackedRows:
    step = 256  # rows added per growth, as mlx-lm's caches do

    def __init__(self, bits: int, group_size: int):
        self.bits, self.group_size = bits, group_size
        self.arrays: Optional[Tuple[mx.array, mx.array, mx.array]] = None  # (B, H, capacity, ...)
        self.length = 0

    def append(self, x: mx.array) -> None:
        """Quantize rows x (B, H, n, D) and store them after the current ones."""
        rows = mx.quantize(x, group_size=self.group_size, bits=self.bits)
        n = x.shape[2]
        if self.arrays is None or self.length + n > self.arrays[0].shape[2]:
            grow = (n + self.step - 1) // self.step * self.step
            fresh = [mx.zeros((*r.shape[:2], grow, r.shape[3]), r.dtype) for r in rows]
            if self.arrays is None:
                self.arrays = tuple(fresh)
            else:
                self.arrays = tuple(mx.concatenate([a[:, :, : self.length], f], axis=2) for a, f in zip(self.arrays, fresh))
        for a, r in zip(self.arrays, rows):
            a[:, :, self.length : self.length + n] = r
        self.length += n

    def view(self) -> Optional[PackedKV]:
        if not self.length:
            return None
        return PackedKV(*(a[:, :, : self.length] for a in self.arrays), self.bits, self.group_size)

    def trim(self, n: int) -> int:
        n = min(n, self.length)
        self.length -= n
        return n

    @property
    def nbytes(self) -> int:
        v = self.view()
        return 0 if v is None else v.packed.nbytes + v.scales.nbytes + v.biases.nbytes

    @property
    def state(self):
        v = self.view()
        return {"arrays": None if v is None else [v.packed, v.scales, v.biases], "bits": self.bits, "group_size": self.group_size}

    @classmethod
    def from_state(cls, state) -> "PackedRows":
        rows = cls(state["bits"], state["group_size"])
        if state["arrays"] is not None:
            rows.arrays = tuple(state["arrays"])
            rows.length = rows.arrays[0].shape[2]
        return rows
