"""`ColumnedKV`: K/V rows plus per-entry columns kept in step with them.

A cache that ranks its entries keeps numbers beside each row (an attention score, the token position,
how many tokens a merged entry stands for). They are columns of the row store: (B, H, capacity)
arrays appended, gathered, trimmed, saved and loaded by the same calls as the rows, so no cache
keeps a second buffer in step by hand.

Columns are bookkeeping, read at an eviction or a save, not at every step. So their writes wait:
an append records the new entries' values (a number, a `range` of positions, or an array) and the
column is written when something reads it, all waiting values in one write. A score column is folded
with each attention call's statistics by one fused op (`accumulate`) that reads entries appended
since the last write as 0. At decode that is one op per layer and step instead of about ten (the
appends' writes and the rule's slice, arithmetic and slice-update), which made every fourth h2o
step, where the bookkeeping is evaluated, ~1.5x the others (docs/cpu-decode.md).
"""

from typing import Dict, List, Optional, Tuple, Union

import mlx.core as mx

from .._native import _ext
from .kv import KVStorage
from .wrapper import KVWrapper
from .rows import capacity_for, flat_rows, gather_rows, grow_rows, pad_indices

# What an append gives a column for its L new entries: one number for all, a range of L positions,
# or an array (L,) or (B, H, L).
ColumnValues = Union[int, float, range, mx.array]


class ColumnedKV(KVWrapper):
    """`rows` (any storage) with named per-entry columns of the given dtypes (by name, "float32":
    a cache deep-copies, and MLX dtypes do not); the rows' other calls are forwarded."""

    def __init__(self, rows: KVStorage, dtypes: Dict[str, str]):
        super().__init__(rows)
        self.dtypes = dict(dtypes)
        self.columns: Optional[Dict[str, mx.array]] = None  # name -> (B, H, capacity)
        self._all_written()

    def _all_written(self) -> None:
        # Per column, (entries, values) of the appends not yet written: the newest entries, so the
        # buffer holds the first length - (their entries) values.
        self._waiting: Dict[str, List[Tuple[int, ColumnValues]]] = {k: [] for k in self.dtypes}

    def _written(self, name: str) -> int:
        """Entries whose values column `name`'s buffer holds."""
        return self.length - sum(L for L, _ in self._waiting[name])

    def column(self, name: str) -> mx.array:
        """Column `name` of the held entries, (B, H, length)."""
        return self._write(name)[..., : self.length]

    def written_columns(self) -> Dict[str, mx.array]:
        """The column buffers with every appended value written (what an evaluation must reach)."""
        for name in self.dtypes:
            self._write(name)
        return self.columns

    def _write(self, name: str) -> mx.array:
        """Write column `name`'s waiting values: a run of equal numbers or of consecutive ranges as
        one write, so a run of decode steps is one op. Returns the column's buffer."""
        if not self._waiting[name]:
            return self.columns[name] if self.columns is not None else None
        merged: List[Tuple[int, ColumnValues]] = []
        for L, v in self._waiting[name]:
            last = merged[-1][1] if merged else None
            if isinstance(v, range) and isinstance(last, range) and last.stop == v.start:
                merged[-1] = (merged[-1][0] + L, range(last.start, v.stop))
            elif isinstance(v, (int, float)) and isinstance(last, (int, float)) and last == v:
                merged[-1] = (merged[-1][0] + L, v)
            else:
                merged.append((L, v))
        a, dtype, start = self.columns[name], getattr(mx, self.dtypes[name]), self._written(name)
        for L, v in merged:
            if isinstance(v, range):
                v = mx.arange(v.start, v.stop, dtype=dtype)
            elif isinstance(v, mx.array):
                v = v.astype(dtype)
            a[..., start : start + L] = v
            start += L
        self.columns[name] = a
        self._waiting[name] = []
        return a

    def accumulate(self, name: str, x: mx.array, alpha: float, beta: float) -> None:
        """Column `name` <- alpha * column + beta * x over the held entries (x: (B, H, length)
        float32), in one op that reads entries appended with the value 0 and not yet written as 0."""
        if x.shape[-1] != self.length or any(not (isinstance(v, (int, float)) and v == 0) for _, v in self._waiting[name]):
            self._write(name)
        self.columns[name] = _ext.accumulate_prefix(self.columns[name], x.astype(mx.float32), float(alpha), float(beta),
                                                    self._written(name))
        self._waiting[name] = []  # the op wrote the waiting zeros (or they were written above)

    def write_column_at(self, name: str, idx: mx.array, values: mx.array) -> None:
        """Overwrite column `name` at entries idx (B, H, n) with `values` (B, H, n)."""
        a = self._write(name)
        f = a.reshape(-1)
        f[flat_rows(idx, a.shape[2])] = values.reshape(-1).astype(a.dtype)
        self.columns[name] = f.reshape(a.shape)

    def append(self, keys, values, capacity=None, **columns: ColumnValues) -> None:
        """Rows as `KVStorage.append`, and each column's values for them (written when read)."""
        if set(columns) != set(self.dtypes):
            raise ValueError(f"append needs the columns {sorted(self.dtypes)}, got {sorted(columns)}")
        B, H, L = keys.shape[:3]
        for name, v in columns.items():
            if _count(v) not in (None, L):
                raise ValueError(f"column {name!r} got {_count(v)} values for {L} entries")
        n = self.length
        if self.columns is None:
            cap = capacity_for(L, capacity)
            self.columns = {k: mx.zeros((B, H, cap), getattr(mx, d)) for k, d in self.dtypes.items()}
        elif n + L > self.columns_capacity:
            written = self.written_columns()
            self.columns = dict(zip(written, grow_rows(written.values(), n, capacity_for(n + L, capacity))))
        self.inner.append(keys, values, capacity)
        for name, v in columns.items():
            self._waiting[name].append((L, v))

    @property
    def columns_capacity(self) -> int:
        return 0 if self.columns is None else next(iter(self.columns.values())).shape[2]

    def gather(self, idx, keep, protected_tail=0, capacity=0) -> None:
        padded = pad_indices(idx, capacity)
        self.columns = {k: gather_rows(a, padded) for k, a in self.written_columns().items()}
        self.inner.gather(idx, keep, protected_tail, capacity)
        self._all_written()

    def trim(self, n: int) -> None:
        self.written_columns()
        self.inner.trim(n)
        self._all_written()

    def nbytes(self) -> int:
        n = self.length
        return self.inner.nbytes() + sum(a[..., :n].nbytes for a in (self.columns or {}).values())

    def state(self):
        if self.columns is None:
            return None
        return {"rows": self.inner.state(), "columns": {k: self.column(k) for k in self.dtypes}}

    def load(self, state) -> None:
        if state is None:  # saved empty: this storage is fresh, nothing to restore
            self.columns = None
            self._all_written()
            return
        self.inner.load(state["rows"])
        self.columns = {k: state["columns"][k] for k in self.dtypes}
        self._all_written()


def _count(v: ColumnValues) -> Optional[int]:
    """Entries a column value covers: a range's length, an array's last axis, None for a number."""
    if isinstance(v, range):
        return len(v)
    if isinstance(v, mx.array):
        return v.shape[-1]
    return None
