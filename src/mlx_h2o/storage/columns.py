"""`ColumnedKV`: K/V rows plus per-entry columns kept in step with them.

A cache that ranks its entries keeps numbers beside each row (an attention score, the token position,
how many tokens a merged entry stands for). They are columns of the row store: (B, H, capacity)
arrays appended, gathered, trimmed, saved and loaded by the same calls as the rows, so no cache
keeps a second buffer in step by hand.
"""

from typing import Dict, Optional

import mlx.core as mx

from .kv import KVStorage
from .wrapper import KVWrapper
from .rows import capacity_for, flat_rows, gather_rows, grow_rows, pad_indices


class ColumnedKV(KVWrapper):
    """`rows` (any storage) with named per-entry columns of the given dtypes (by name, "float32":
    a cache deep-copies, and MLX dtypes do not); the rows' other calls are forwarded."""

    def __init__(self, rows: KVStorage, dtypes: Dict[str, str]):
        super().__init__(rows)
        self.dtypes = dict(dtypes)
        self.columns: Optional[Dict[str, mx.array]] = None  # name -> (B, H, capacity)

    def column(self, name: str) -> mx.array:
        """Column `name` of the held entries, (B, H, length)."""
        return self.columns[name][..., : self.length]

    def set_column(self, name: str, values: mx.array) -> None:
        """Overwrite column `name` of the held entries with `values` (B, H, length)."""
        self.columns[name][..., : values.shape[-1]] = values

    def write_column_at(self, name: str, idx: mx.array, values: mx.array) -> None:
        """Overwrite column `name` at entries idx (B, H, n) with `values` (B, H, n)."""
        a = self.columns[name]
        f = a.reshape(-1)
        f[flat_rows(idx, a.shape[2])] = values.reshape(-1).astype(a.dtype)
        self.columns[name] = f.reshape(a.shape)

    def append(self, keys, values, capacity=None, **columns) -> None:
        """Rows as `KVStorage.append`, and each column's values (B, H, L) for them."""
        if set(columns) != set(self.dtypes):
            raise ValueError(f"append needs the columns {sorted(self.dtypes)}, got {sorted(columns)}")
        B, H, L = keys.shape[:3]
        n = self.length
        if self.columns is None:
            cap = capacity_for(L, capacity)
            self.columns = {k: mx.zeros((B, H, cap), getattr(mx, d)) for k, d in self.dtypes.items()}
        elif n + L > self.columns_capacity:
            self.columns = dict(zip(self.columns, grow_rows(self.columns.values(), n, capacity_for(n + L, capacity))))
        self.inner.append(keys, values, capacity)
        for name, v in columns.items():
            self.columns[name][..., n : n + L] = mx.broadcast_to(v, (B, H, L)).astype(getattr(mx, self.dtypes[name]))

    @property
    def columns_capacity(self) -> int:
        return 0 if self.columns is None else next(iter(self.columns.values())).shape[2]

    def gather(self, idx, keep, protected_tail=0, capacity=0) -> None:
        padded = pad_indices(idx, capacity)
        self.columns = {k: gather_rows(a, padded) for k, a in self.columns.items()}
        self.inner.gather(idx, keep, protected_tail, capacity)

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
            return
        self.inner.load(state["rows"])
        self.columns = {k: state["columns"][k] for k in self.dtypes}
