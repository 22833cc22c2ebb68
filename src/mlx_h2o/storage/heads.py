"""Ragged K/V storage: one storage per (batch row, kv head), so heads hold different numbers of rows
with no padding.

A cache whose kv heads keep different numbers of entries (per-head budgets) would otherwise store a
(B, H, max rows) rectangle, paying for the longest head in every head: with one head at 1.8x the mean
that is 80 % more memory. Here each (b, h) owns a storage of its own (any storage: dense, packed,
tiered), shaped (1, 1, n_bh, D), grown and compacted independently, and the fused kernel attends
each head's query group over that head's segments (`head_segments`): no padded row is stored or
read. The price is one kernel call per (batch row, kv head) instead of one per layer.

Interface: the storage interface of kv.py where it applies per head (append splits the rows, trim
drops every head's newest rows, nbytes / state / load cover all parts), plus
  lengths                            (B, H) rows per head (NumPy)
  head_segments(b, h)                the segments of head h of batch row b
  gather_heads(idx, counts, protected_tail, spare)
                                     head (b, h) keeps rows idx[b, h, :counts[b, h]] (ascending), with
                                     room for `spare` more rows
`segments()` / `fetch()` / `read_rows()` have no single-array answer and raise.
"""

from typing import Callable, List, Optional

import mlx.core as mx
import numpy as np

from .kv import KVStorage


class PerHeadKV(KVStorage):
    """One storage per (batch row, kv head), made by `make_part()` (see the module docstring)."""

    def __init__(self, make_part: Callable[[], KVStorage]):
        self.make_part = make_part
        self.parts: Optional[List[List[KVStorage]]] = None  # parts[b][h]

    @property
    def lengths(self) -> np.ndarray:
        if self.parts is None:
            return np.zeros((0, 0), np.int64)
        return np.array([[p.length for p in row] for row in self.parts], np.int64)

    @property
    def length(self) -> int:
        """The most rows any head holds."""
        return int(self.lengths.max()) if self.parts else 0

    def append(self, keys: mx.array, values: mx.array, capacity: Optional[int] = None) -> None:
        B, H = keys.shape[:2]
        if self.parts is None:
            self.parts = [[self.make_part() for _ in range(H)] for _ in range(B)]
        elif (B, H) != (len(self.parts), len(self.parts[0])):
            raise ValueError(f"rows for {B} x {H} heads, but the storage holds {len(self.parts)} x {len(self.parts[0])}")
        for b, row in enumerate(self.parts):
            for h, part in enumerate(row):
                part.append(keys[b : b + 1, h : h + 1], values[b : b + 1, h : h + 1], capacity)

    def gather_heads(self, idx: mx.array, counts: np.ndarray, protected_tail: int = 0, spare: int = 0) -> None:
        for b, row in enumerate(self.parts):
            for h, part in enumerate(row):
                n = int(counts[b, h])
                part.gather(idx[b : b + 1, h : h + 1, :n], n, protected_tail, n + spare)

    def gather(self, idx: mx.array, keep: int, protected_tail: int = 0, capacity: int = 0) -> None:
        counts = np.full((len(self.parts), len(self.parts[0])), keep)
        self.gather_heads(idx, counts, protected_tail, max(capacity - keep, 0))

    def trim(self, n: int) -> None:
        for row in self.parts or []:
            for part in row:
                part.trim(n)

    def head_segments(self, b: int, h: int) -> list:
        return self.parts[b][h].segments()

    def segments(self) -> list:
        raise ValueError("per-head storage has no segments over all heads: attend each head over head_segments(b, h)")

    def fetch(self):
        return self.segments(), None

    def read_rows(self):
        raise ValueError("per-head storage holds ragged rows: no (B, H, N, D) array of them exists")

    def write_rows(self, idx, keys, values) -> None:
        raise ValueError("per-head storage holds ragged rows: rewrite them per head")

    def nbytes(self) -> int:
        return sum(p.nbytes() for row in self.parts or [] for p in row)

    def state(self):
        return None if self.parts is None else [[p.state() for p in row] for row in self.parts]

    def load(self, state) -> None:
        if state is None:
            self.parts = None
            return
        self.parts = []
        for row in state:
            self.parts.append([])
            for s in row:
                part = self.make_part()
                part.load(s)
                self.parts[-1].append(part)
