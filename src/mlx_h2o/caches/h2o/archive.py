"""`ArchiveKVCache`: keep, don't drop, in a third tier (`evicted_bits`): entries evicted from the
h2o cache move to a low-bit archive instead of disappearing, and attention reads both.

At equal bytes. Of the bytes M entries take in the cache's own format (plus their 8 bytes of
bookkeeping), `evicted_share` goes to the archive: the cache itself keeps M' = M - share x M entries
(its recent window first, budgets.layer_config), and the archive holds as many entries at
`evicted_bits` as the rest of the bytes buy (e.g. M = 256 fp32 rows of 512 bytes, share 0.5: 128
entries in the cache, 924 in a 2-bit archive of 64 bytes a row). nbytes reports both, so the tables
show the bytes actually held.

How it runs:
- the archive is a `KVStore` at `evicted_bits` in the cache storage's own space (rows come from
  `read_rows()`, so with `rotate=True` they are rotated once and the same rotated query reads both);
- an eviction moves the rows the plan drops into the archive with their score and position; when
  the archive is over its size it drops its lowest priorities (the same rule);
- attention runs one fused call over [archive segments] + [cache segments]: the new rows stay at the
  end, so the causal mask is unchanged; the scores are split between the two.
"""

import mlx.core as mx

from ...storage import KVStore, gather_rows, pad_indices, role_bits
from .budgets import layer_config
from .cache import H2OKVCache
from .eviction import select_entries
from .options import H2OConfig

BOOKKEEPING_BYTES = 8  # per entry: float32 score + int32 position


def row_bytes(bits, head_dim_k: int, head_dim_v: int, group_size: int, itemsize: int) -> int:
    """Bytes of one (kv head, token) entry: K and V rows in format `bits` (storage/kv.py)."""
    def one(b, d):
        if b is None:
            return d * itemsize
        return d * b // 8 + (d // group_size) * 2 * itemsize  # packed words + scale and bias per group

    k_bits, v_bits = role_bits(bits)
    return one(k_bits, head_dim_k) + one(v_bits, head_dim_v)


class ArchiveKVCache(H2OKVCache):
    """h2o whose evicted entries live on at low bits (see the module docstring)."""

    def __init__(self, config, seed: int = 0):
        self.full_config = config  # M before the split with the archive
        super().__init__(config, seed)

    def reset(self):
        self.config = self.full_config
        super().reset()
        self.archive = KVStore(self.config.evicted_format(), self.config.kv_group_size)
        self.archive_acc = self.archive_positions = None
        self.archive_size = None  # entries the archive holds at most (set with the first rows)

    def update_and_fetch(self, keys, values):
        if self.archive_size is None:
            self._size_tiers(keys, values)
        return super().update_and_fetch(keys, values)

    def _size_tiers(self, keys, values):
        """Split the bytes of M entries between the cache (M') and the archive, once."""
        cfg = self.config
        older, _ = cfg.tiers()
        D_k, D_v, g = keys.shape[-1], values.shape[-1], cfg.kv_group_size
        own = row_bytes(older, D_k, D_v, g, keys.dtype.size) + BOOKKEEPING_BYTES
        low = row_bytes(cfg.evicted_format(), D_k, D_v, g, keys.dtype.size) + BOOKKEEPING_BYTES
        moved = int(round(cfg.evicted_share * cfg.max_kv_size))
        self.config = layer_config(cfg, cfg.max_kv_size - moved)
        self.archive_size = moved * own // low
        self.row_dtype = keys.dtype

    @property
    def nbytes(self):
        n = self.archive.length
        return super().nbytes + self.archive.nbytes() + n * BOOKKEEPING_BYTES

    def make_mask(self, N, return_array=False, window_size=None):
        mask = super().make_mask(N, return_array, window_size)
        if isinstance(mask, mx.array) and self.archive.length:
            # The archive's rows come first and are older than every query row.
            mask = mx.concatenate([mx.ones((*mask.shape[:-1], self.archive.length), mask.dtype), mask], axis=-1)
        return mask

    def _payload(self):
        out = super()._payload()
        if out is not None:
            n = self.archive.length
            out["archive"] = None if not n else {"rows": self.archive.state(), "acc": self.archive_acc[..., :n],
                                                 "positions": self.archive_positions[..., :n]}
        return out

    def _meta(self):
        return {**super()._meta(), "archive_size": self.archive_size, "full_config": self.full_config.to_json(), "row_dtype": str(getattr(self, "row_dtype", "")).split(".")[-1]}

    def _restore(self, payload, meta):
        super()._restore(payload, meta)
        self.full_config = H2OConfig.from_json(meta["full_config"])
        self.archive_size = meta["archive_size"]
        if meta.get("row_dtype"):
            self.row_dtype = getattr(mx, meta["row_dtype"])
        arch = None if payload is None else payload.get("archive")
        if arch is not None:
            self.archive.load(arch["rows"])
            self.archive_acc, self.archive_positions = arch["acc"], arch["positions"]

    # ------------------------------------------------------------------ eviction into the archive
    def _evict(self, keep: int, capacity: int):
        n = self.length
        idx, recent = self._plan(keep, n)  # padding past `keep` is free: the dropped entries are found below
        kept = (mx.arange(n)[None, None, :, None] == idx[:, :, None, :keep]).any(axis=-1)
        dropped = mx.argsort(kept.astype(mx.int32), axis=-1)[..., : n - keep]  # not kept sort first
        if not self.scoreless:
            keys, values = self.store.read_rows()
            self._archive(gather_rows(keys, dropped), gather_rows(values, dropped),
                          gather_rows(self.acc[..., :n], dropped), gather_rows(self.positions[..., :n], dropped))
        self._keep(pad_indices(idx[..., :keep], capacity), keep, recent, capacity)

    def _archive(self, keys, values, acc, positions):
        """Append evicted entries to the archive; over its size, it drops its lowest priorities."""
        old = self.archive.length
        self.archive.append(keys.astype(self.row_dtype), values.astype(self.row_dtype))
        if self.archive_acc is None:
            self.archive_acc, self.archive_positions = acc, positions
        else:
            self.archive_acc = mx.concatenate([self.archive_acc[..., :old], acc], axis=-1)
            self.archive_positions = mx.concatenate([self.archive_positions[..., :old], positions], axis=-1)
        A = self.archive_size
        if self.archive.length > A:
            priority = self.rule.priority(self.archive_acc, self.archive_positions, self.offset)
            idx = select_entries(priority, mx.zeros(priority.shape, mx.bool_), A, False)
            # Room for the next eviction's rows, so appending does not reallocate.
            self.archive.gather(idx, A, 0, A + keys.shape[2])
            self.archive_acc = gather_rows(self.archive_acc, idx)
            self.archive_positions = gather_rows(self.archive_positions, idx)

    # ------------------------------------------------------------------ attention over both
    def _attention(self, queries, keys, values, scale, mask, sinks):
        T = self.archive.length
        if not T:
            return super()._attention(queries, keys, values, scale, mask, sinks)
        own = keys if isinstance(keys, list) else [(keys, values)]
        out, raw, stats, rows, live = super()._attention(queries, self.archive.segments() + own, None, scale, mask, sinks,
                                                         held=self.length + T)
        self.archive_acc = self.rule.update(self.archive_acc, stats[..., :T], rows, live)
        return out, raw, stats[..., T:], rows, live
