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
step, where the bookkeeping was evaluated, ~1.5x the others (docs/cpu-decode.md).

Dead rows (`masks_shared`): rows shared with copies of the store (storage/kv.py, a prompt-cache
snapshot that N requests fork) would be copied by the first compaction, into each request. Instead a
compaction may leave that prefix in place and mark the rows it does not keep as dead: attention and
the next eviction skip them (`dead_rows`), and only the rows after the prefix are compacted, each head
to its own count, padded with dead rows to the largest. So N requests that evict still hold the
prefix once, as long as they keep most of it.
"""

from typing import Dict, List, Optional, Tuple, Union

import mlx.core as mx
import numpy as np

from .._native import _ext
from .kv import KVStorage, tail_capacity
from .wrapper import KVWrapper
from .rows import capacity_for, flat_rows, grow_rows, pad_indices, take_rows

# What an append gives a column for its L new entries: one number for all, a range of L positions,
# or an array (L,) or (B, H, L).
ColumnValues = Union[int, float, range, mx.array]


class ColumnedKV(KVWrapper):
    """`rows` (any storage) with named per-entry columns of the given dtypes (by name, "float32":
    a cache deep-copies, and MLX dtypes do not); the rows' other calls are forwarded."""

    def __init__(self, rows: KVStorage, dtypes: Dict[str, str], masks_shared: bool = False):
        super().__init__(rows)
        self.dtypes = dict(dtypes)
        self.columns: Optional[Dict[str, mx.array]] = None  # name -> (B, H, capacity)
        self._all_written()
        # Whether a compaction may keep a shared prefix in place (module docstring): only for
        # owners that skip dead rows everywhere they read rows (an h2o lane without archive or merge).
        self.masks_shared = masks_shared
        self.dead: Optional[mx.array] = None  # (B, H, n) bool over the first n rows; the rest are live
        self.dead_count = 0  # dead rows per (batch, head): every head holds as many live ones

    @property
    def live_length(self) -> int:
        """Rows held less the dead ones (as many in every head)."""
        return self.length - self.dead_count

    def dead_rows(self) -> Optional[mx.array]:
        """(B, H, length) bool, True where a row is dead; None when every row is live."""
        if self.dead is None:
            return None
        n = self.length - self.dead.shape[-1]
        return self.dead if n == 0 else mx.pad(self.dead, [(0, 0), (0, 0), (0, n)])

    def _all_written(self) -> None:
        # Per column, (entries, values) of the appends not yet written: the newest entries, so the
        # buffer holds the first length - (their entries) values.
        self._waiting: Dict[str, List[Tuple[int, ColumnValues]]] = {k: [] for k in self.dtypes}

    def _written(self, name: str, length: Optional[int] = None) -> int:
        """Entries whose values column `name`'s buffer holds; `length`: self.length where the caller
        has it (a wrapped storage's length is a chain of calls)."""
        return (self.length if length is None else length) - sum(L for L, _ in self._waiting[name])

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
        a, dtype, start = self.columns[name], getattr(mx, self.dtypes[name]), self._written(name)
        for L, v in self._waiting[name]:  # (runs merged as they were appended: _wait)
            if isinstance(v, range):
                v = mx.arange(v.start, v.stop, dtype=dtype)
            elif isinstance(v, mx.array):
                v = v.astype(dtype)
            a[..., start : start + L] = v
            start += L
        self.columns[name] = a
        self._waiting[name] = []
        return a

    def accumulate(self, name: str, x: mx.array, alpha: float, beta: float, along: Optional[mx.array] = None):
        """Column `name` <- alpha * column + beta * x over the held entries (x: (B, H, length)
        float32), in one op that reads entries appended with the value 0 and not yet written as 0.
        `along`: an array passed through the op and returned, whose evaluation then brings the
        column's (an attention output carrying its score update: no Depends primitive per call)."""
        column, held = self.folding(name, x.shape[-1])
        args = (column, x if x.dtype == mx.float32 else x.astype(mx.float32), float(alpha), float(beta), held)
        if along is None:
            self.columns[name] = _ext.accumulate_prefix(*args)
            return None
        self.columns[name], along = _ext.accumulate_prefix_along(*args, along)
        return along

    def folding(self, name: str, n: int) -> Tuple[mx.array, int]:
        """(buffer, held) of column `name` for an op that folds statistics of its first n entries into
        it (accumulate_prefix, or the attention op's score column): entries at or past `held` read as
        0, the waiting zeros the op then writes. The caller sets the op's result (`folded`)."""
        length = held = self.length
        for entries, v in self._waiting[name]:
            if n != length or not (isinstance(v, (int, float)) and v == 0):
                self._write(name)  # (then the buffer holds every value)
                held = length
                break
            held -= entries
        self._waiting[name] = []  # the op writes the waiting zeros (or they were written above)
        return self.columns[name], held

    def folded(self, name: str, column: mx.array) -> None:
        """Column `name` is `column`, the result of an op `folding` prepared."""
        self.columns[name] = column

    def write_column_at(self, name: str, idx: mx.array, values: mx.array) -> None:
        """Overwrite column `name` at entries idx (B, H, n) with `values` (B, H, n)."""
        a = self._write(name)
        f = a.reshape(-1)
        f[flat_rows(idx, a.shape[2])] = values.reshape(-1).astype(a.dtype)
        self.columns[name] = f.reshape(a.shape)

    def append(self, keys, values, capacity=None, transform=None, **columns: ColumnValues) -> None:
        """Rows as `KVStorage.append`, and each column's values for them (written when read)."""
        B, H, L = keys.shape[:3]
        self._check_columns(columns, L)
        n = self.length
        if self.columns is None:
            cap = capacity_for(L, capacity)
            self.columns = {k: mx.zeros((B, H, cap), getattr(mx, d)) for k, d in self.dtypes.items()}
        elif n + L > self.columns_capacity:
            written = self.written_columns()
            self.columns = dict(zip(written, grow_rows(written.values(), n, capacity_for(n + L, capacity))))
        self.inner.append(keys, values, capacity, transform)
        for name, v in columns.items():
            _wait(self._waiting[name], L, v)

    def append_in_place(self, keys, values, **columns: ColumnValues):
        """`KVStorage.append_in_place` with each column's values, waiting as `append` leaves them."""
        L = keys.shape[2]
        if self.columns is None or self.length + L > self.columns_capacity:
            return None
        self._check_columns(columns, L)
        fetched = self.inner.append_in_place(keys, values)
        if fetched is not None:
            for name, v in columns.items():
                _wait(self._waiting[name], L, v)
        return fetched

    def _check_columns(self, columns: Dict[str, ColumnValues], L: int) -> None:
        """An append's column values: one for each column, covering its L entries."""
        if columns.keys() != self.dtypes.keys():
            raise ValueError(f"append needs the columns {sorted(self.dtypes)}, got {sorted(columns)}")
        for name, v in columns.items():
            if not isinstance(v, (int, float)) and _count(v) != L:
                raise ValueError(f"column {name!r} got {_count(v)} values for {L} entries")

    @property
    def columns_capacity(self) -> int:
        return 0 if self.columns is None else next(iter(self.columns.values())).shape[2]

    def gather(self, idx, keep, protected_tail=0, capacity=0) -> None:
        """`KVStorage.gather`; idx names live rows only. With `masks_shared`, a prefix shared with
        copies stays in place when every head keeps at least half of it (_gather_after_shared)."""
        if self.masks_shared and self._gather_after_shared(idx, keep, capacity):
            return
        padded = pad_indices(idx, capacity)
        self.columns = _taken(self.written_columns(), padded)
        self.inner.gather(idx, keep, protected_tail, capacity)
        self._all_written()
        self.dead, self.dead_count = None, 0

    def _gather_after_shared(self, idx: mx.array, keep: int, capacity: int) -> bool:
        """Keep rows idx[..., :keep] (ascending), leaving the shared prefix in place: its rows not in
        idx become dead, and the rows after it are compacted per head to the largest count any head
        keeps, the shorter heads padded with dead rows. False (nothing done) when there is no shared
        prefix or some head keeps less than half of it: then reading the dead rows would cost more
        than copying the live ones."""
        S = self.inner.shared_length
        if not S:
            return False
        idx = idx[..., :keep]  # (sliced only here: a compaction without a shared prefix never uses it)
        B, H = idx.shape[:2]
        in_prefix = idx < S
        kept_in_prefix = np.array(in_prefix.sum(axis=-1))  # evaluates the eviction's choice (one sync)
        if kept_in_prefix.min() * 2 < S:
            return False
        T = int((keep - kept_in_prefix).max())  # rows after the prefix kept, at most over the heads
        after = mx.sort(mx.where(in_prefix, self.length, idx - S), axis=-1)[..., :T]  # theirs first, then padding
        real = after < self.length
        after = mx.where(real, after, 0)
        prefix_kept = mx.zeros((B * H * (S + 1),), mx.bool_)  # a spare slot S takes the indices past the prefix
        prefix_kept[flat_rows(mx.where(in_prefix, idx, S), S + 1)] = True
        own_capacity = tail_capacity(T, capacity or None, S)
        rows = mx.concatenate([mx.broadcast_to(mx.arange(S, dtype=idx.dtype), (B, H, S)), S + pad_indices(after, own_capacity)], axis=-1)
        self.columns = _taken(self.written_columns(), rows)
        self.inner.gather_own(after, T, own_capacity)
        self._all_written()
        self.dead = mx.concatenate([~prefix_kept.reshape(B, H, S + 1)[..., :S], ~real], axis=-1)
        self.dead_count = S + T - keep
        if "pos" in self.columns:  # a dead row is at no position: no trim or recency rule takes it for a token
            pos = self.columns["pos"]
            pos[..., : S + T] = mx.where(self.dead, -1, pos[..., : S + T])
        return True

    def trim(self, n: int) -> None:
        if self.dead is not None and self.length - n < self.dead.shape[-1]:
            # (an h2o lane trims only its run of consecutive positions, which no dead row is in)
            cut = self.length - n
            if np.array(self.dead[..., cut:].any()):
                raise ValueError("trim would forget rows a compaction marked dead: live rows would differ between heads")
            self.dead = self.dead[..., :cut]
        self.written_columns()
        self.inner.trim(n)
        self._all_written()

    def nbytes(self) -> int:
        n = self.length
        dead = 0 if self.dead is None else self.dead.nbytes
        return self.inner.nbytes() + sum(a[..., :n].nbytes for a in (self.columns or {}).values()) + dead

    def state(self):
        if self.columns is None:
            return None
        state = {"rows": self.inner.state(), "columns": {k: self.column(k) for k in self.dtypes}}
        return state if self.dead is None else {**state, "dead": self.dead}

    def load(self, state) -> None:
        if state is None:  # saved empty: this storage is fresh, nothing to restore
            self.columns = None
            self._all_written()
            self.dead, self.dead_count = None, 0
            return
        self.inner.load(state["rows"])
        self.columns = {k: state["columns"][k] for k in self.dtypes}
        self._all_written()
        self.dead = state.get("dead")  # (saved rows hold no shared prefix, but keep the dead ones)
        self.dead_count = 0 if self.dead is None else int(np.array(self.dead[0, 0].sum()))


def _wait(waiting: List[Tuple[int, ColumnValues]], L: int, v: ColumnValues) -> None:
    """Add an append's (L, values) to a column's waiting writes, merged into the last one where they
    continue it (a run of equal numbers, or of consecutive ranges): a run of decode steps waits as
    one write, however many steps pass before something reads the column."""
    if waiting:
        n, last = waiting[-1]
        if isinstance(v, range) and isinstance(last, range) and last.stop == v.start:
            waiting[-1] = (n + L, range(last.start, v.stop))
            return
        if isinstance(v, (int, float)) and isinstance(last, (int, float)) and last == v:
            waiting[-1] = (n + L, v)
            return
    waiting.append((L, v))


def _taken(columns: Dict[str, mx.array], idx: mx.array) -> Dict[str, mx.array]:
    """The columns' entries idx (B, H, k), every column in one primitive (take_rows)."""
    return dict(zip(columns, take_rows(list(columns.values()), idx)))


def _count(v: ColumnValues) -> Optional[int]:
    """Entries a column value covers: a range's length, an array's last axis, None for a number."""
    if isinstance(v, range):
        return len(v)
    if isinstance(v, mx.array):
        return v.shape[-1]
    return None
