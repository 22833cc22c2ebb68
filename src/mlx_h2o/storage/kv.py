"""K/V storage for caches: K and V rows side by side, in one format (`KVStore`) or in two precision
tiers (`TieredKV`). Storage knows nothing of eviction policies: a cache appends rows, asks for a
compaction that keeps rows it chose, and hands `segments()` to the fused kernel. `KVStorage`
declares the protocol every storage implements (the rotation wrapper, storage/rotation.py, and the
per-entry columns, storage/columns.py, included).

A format is `bits` (None = the model's dtype, or 2-8 packed) for K and V alike, or a (k_bits,
v_bits) pair: keys are the sensitive half, so K8/V4 spends its bits where they matter.
"""

from abc import ABC, abstractmethod
from typing import Optional, Tuple

import mlx.core as mx

from .rows import RowStore, capacity_for, pad_indices


class KVStorage(ABC):
    """K/V rows of one cache layer, (B, H, rows, D) per tensor, in row order."""

    @property
    @abstractmethod
    def length(self) -> int:
        """Rows held."""

    @abstractmethod
    def append(self, keys: mx.array, values: mx.array, capacity: Optional[int] = None) -> None:
        """Write rows (B, H, L, D) after the held ones; `capacity` sizes the buffers when they grow
        (None: steps of GROW_STEP rows)."""

    @abstractmethod
    def gather(self, idx: mx.array, keep: int, protected_tail: int = 0, capacity: int = 0) -> None:
        """Keep rows idx[..., :keep] (ascending) per (batch, head), in buffers of `capacity` rows; the
        last `protected_tail` of them are the newest rows (a tiered storage keeps them in its high tier)."""

    @abstractmethod
    def trim(self, n: int) -> None:
        """Forget the newest n rows."""

    @abstractmethod
    def segments(self) -> list:
        """[(k, v)] in row order, each an mx.array or a PackedKV: what the fused kernel reads."""

    @abstractmethod
    def read_rows(self) -> Tuple[mx.array, mx.array]:
        """Every row's (keys, values) as dense float32 arrays in row order, in the stored space (for
        policies that look at key / value content)."""

    @abstractmethod
    def write_rows(self, idx: mx.array, keys: mx.array, values: mx.array) -> None:
        """Overwrite rows idx (B, H, n) with dense keys / values (B, H, n, D) in the stored space
        (packed rows are re-quantized)."""

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of the rows held."""

    @abstractmethod
    def state(self):
        """The rows as a tree of arrays (None when empty) that `load` takes back."""

    @abstractmethod
    def load(self, state) -> None: ...

    def fetch(self):
        """What a cache's update_and_fetch returns: (keys, values) arrays for dense rows (models may
        use them directly), else (segments(), None)."""
        return self.segments(), None

    def prepare_queries(self, queries: mx.array) -> mx.array:
        """Queries in the stored space (identity here; a rotation there)."""
        return queries

    def restore_output(self, out: mx.array, dtype) -> mx.array:
        """An attention output over the stored values, back in the model's space and dtype."""
        return out


def role_bits(bits) -> Tuple[Optional[int], Optional[int]]:
    """A format (module docstring) as (k_bits, v_bits)."""
    return tuple(bits) if isinstance(bits, (tuple, list)) else (bits, bits)


class KVStore(KVStorage):
    """K and V rows in one format: dense (`bits=None`), packed at `bits`, or K and V at their own
    bits (`bits=(k_bits, v_bits)`)."""

    def __init__(self, bits=None, group_size: int = 32):
        k_bits, v_bits = role_bits(bits)
        self.k, self.v = RowStore(k_bits, group_size), RowStore(v_bits, group_size)
        self._length = 0

    @property
    def length(self) -> int:
        return self._length

    @property
    def capacity(self) -> int:
        return self.k.capacity

    def append(self, keys: mx.array, values: mx.array, capacity: Optional[int] = None) -> None:
        ek, ev = self.k.encode(keys), self.v.encode(values)
        needed = self.length + keys.shape[2]
        if needed > self.capacity:
            capacity = capacity_for(needed, capacity)
            self.k.reserve(ek, self.length, capacity)
            self.v.reserve(ev, self.length, capacity)
        self.k.write(self.length, ek)
        self.v.write(self.length, ev)
        self._length = needed

    def gather(self, idx: mx.array, keep: int, protected_tail: int = 0, capacity: int = 0) -> None:
        idx = pad_indices(idx, capacity)
        self.k.gather(idx)
        self.v.gather(idx)
        self._length = keep

    def drop_front(self, n: int) -> None:
        """Forget the oldest n rows (the rest keeps no spare room)."""
        self.k.drop_front(n, self.length)
        self.v.drop_front(n, self.length)
        self._length -= n

    def decode(self, start: int, stop: int):
        """Rows [start, stop) of K and V as dense values in the stored dtype."""
        return self.k.decode(start, stop, self.k.dtype), self.v.decode(start, stop, self.v.dtype)

    def read_rows(self):
        return self.k.decode(0, self.length, mx.float32), self.v.decode(0, self.length, mx.float32)

    def write_rows(self, idx: mx.array, keys: mx.array, values: mx.array) -> None:
        self.k.write_at(idx, keys)
        self.v.write_at(idx, values)

    def trim(self, n: int) -> None:
        self._length -= n

    def segments(self) -> list:
        return [(self.k.view(self.length), self.v.view(self.length))] if self.length else []

    def fetch(self):
        if self.k.bits is None and self.v.bits is None:
            return self.k.view(self.length), self.v.view(self.length)
        return super().fetch()

    def nbytes(self) -> int:
        return self.k.nbytes(self.length) + self.v.nbytes(self.length)

    def state(self):
        return {"k": self.k.state(self.length), "v": self.v.state(self.length)} if self.length else None

    def load(self, state) -> None:
        if state is None:
            self._length = 0
            self.k.arrays = self.v.arrays = None
            return
        self.k.load(state["k"])
        self.v.load(state["v"])
        self._length = self.k.capacity


class TieredKV(KVStorage):
    """Mixed precision: the low tier's rows followed by the high tier's, in row order. New rows enter
    the high tier; a row is converted to the low tier's format once, when it leaves the newest
    `window` rows. A compaction keeps the high tier whole (the protected newest rows) and gathers in
    the low tier."""

    def __init__(self, low_bits, high_bits, window: int, group_size: int = 32):
        self.low, self.high = KVStore(low_bits, group_size), KVStore(high_bits, group_size)
        self.window = window

    @property
    def length(self) -> int:
        return self.low.length + self.high.length

    def append(self, keys, values, capacity: Optional[int] = None) -> None:
        # Exact room: demote() cuts the high tier back to its newest rows, so spare capacity there
        # would be allocated and dropped on every call.
        self.high.append(keys, values, self.high.length + keys.shape[2])
        self.demote(self.window, capacity)

    def demote(self, keep_high: int, capacity: Optional[int]) -> None:
        """Convert all but the newest `keep_high` high-tier rows to the low tier's format."""
        n = self.high.length - keep_high
        if n <= 0:
            return
        k, v = self.high.decode(0, n)
        self.low.append(k, v, None if capacity is None else max(capacity, self.low.length + n))
        self.high.drop_front(n)

    def gather(self, idx: mx.array, keep: int, protected_tail: int = 0, capacity: int = 0) -> None:
        self.demote(protected_tail, capacity)
        low_keep = keep - self.high.length
        self.low.gather(idx[..., :low_keep], low_keep, capacity=capacity)

    def read_rows(self):
        if not self.low.length:  # nothing has left the newest rows yet
            return self.high.read_rows()
        (lk, lv), (hk, hv) = self.low.read_rows(), self.high.read_rows()
        return mx.concatenate([lk, hk], axis=2), mx.concatenate([lv, hv], axis=2)

    def write_rows(self, idx, keys, values) -> None:
        raise ValueError("rows of a two-tier storage cannot be rewritten in place; use one format")

    def trim(self, n: int) -> None:
        from_high = min(n, self.high.length)
        self.high.trim(from_high)
        self.low.trim(n - from_high)

    def segments(self) -> list:
        return self.low.segments() + self.high.segments()

    def nbytes(self) -> int:
        return self.low.nbytes() + self.high.nbytes()

    def state(self):
        return {"low": self.low.state(), "high": self.high.state()}

    def load(self, state) -> None:
        self.low.load(state["low"])
        self.high.load(state["high"])


def make_kv_storage(low_bits, high_bits, window: int, group_size: int = 32) -> KVStorage:
    """One format when both tiers agree, else older rows at `low_bits` and the newest `window` rows at
    `high_bits` (formats as in the module docstring; None: the model's dtype)."""
    if role_bits(low_bits) == role_bits(high_bits):
        return KVStore(low_bits, group_size)
    return TieredKV(low_bits, high_bits, window, group_size)
