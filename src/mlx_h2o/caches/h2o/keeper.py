"""The keeper of an h2o cache: what happens to the entries an eviction does not keep. It drops them,
merges each into its most similar kept entry (CaM / D2O), or moves them to a low-bit archive that
attention keeps reading (`evicted_bits`).

The archive is sized at equal bytes. Of the bytes M entries take in the cache's own format (plus
their 8 bytes of bookkeeping), `evicted_share` goes to the archive: the cache itself keeps
M' = M - share x M entries (its recent window first, Budget.for_layer), and the archive holds as
many entries at `evicted_bits` as the rest of the bytes buy (e.g. M = 256 fp32 rows of 512 bytes,
share 0.5: 128 entries in the cache, 924 in a 2-bit archive of 64 bytes a row). Its rows are in the
storage's own space (read_rows: rotated once, so the same rotated query reads both); when it is over
its size it drops its lowest priorities (the same rule).
"""

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from ...options import Choice, Float, option
from ...storage import pad_indices, take_rows
from .eviction import select_entries
from .lane import Lane
from .scorer import unit_centred
from .storage import row_bytes, tier_bits

EVICTED_BITS = ("2", "3", "4", "8", "k8v4", "k4v2")
BOOKKEEPING_BYTES = 8  # per entry: float32 score + int32 position


@dataclass(frozen=True)
class Keeper:
    """Drop, merge or archive the entries an eviction does not keep.

    Parameters
    ----------
    merge:
        fold an evicted entry into the kept entry whose key is most similar when their cosine
        similarity is at least this; unset: evicted entries are not merged.
    evicted_bits:
        move evicted entries to an archive at these bits; unset: no archive.
    evicted_share:
        with evicted_bits, the share of the bytes of M entries given to the archive.
    """

    merge: Optional[float] = option(
        Float(-1.0, 1.0), None,
        "keep, don't drop: fold an evicted entry into the kept entry whose key is most similar when their cosine similarity "
        ">= this (K/V averaged, + log multiplicity on its logit; CaM / D2O); unset: evicted entries are dropped")
    evicted_bits: Optional[str] = option(
        Choice(EVICTED_BITS, ((2, "2"), (3, "3"), (4, "4"), (8, "8"))), None,
        "keep, don't drop: evicted entries move to a third tier at these bits (`k8v4`: 8-bit keys, 4-bit values), "
        "attended with the rest; unset: they are dropped. Measured at equal bytes: with float rows (M = 256) `2` recalls an "
        "evicted span that h2o alone loses (49-63 % against <= 3 %, held out) and mostly costs perplexity; beside the byte "
        "rule's packed rows it adds no recall (docs/h2o.md#byte-budget)")
    evicted_share: float = option(
        Float(0.0, 1.0), 0.5,
        "with evicted_bits: the share of the bytes of M entries given to that tier (the cache keeps the rest, at equal total bytes)")

    def __post_init__(self):
        if self.merge is not None and self.evicted_bits is not None:
            raise ValueError("merge and evicted_bits are two ways to keep evicted entries: give one")

    def check(self, config) -> None:
        if self.merge is not None and not config.storage.single_format:
            raise ValueError("merge rewrites kept rows in place: it needs one storage format (kv_bits without a '/')")
        M, sink = config.budget.max_kv_size, config.budget.sink
        if self.evicted_bits is not None and M - self._share(M) <= sink:
            raise ValueError(f"evicted_share={self.evicted_share} leaves no entry beyond the sink in the cache")

    @property
    def archive_format(self):
        """The archive's storage format (storage/kv.py), or None when there is no archive."""
        return None if self.evicted_bits is None else tier_bits(self.evicted_bits)

    def moved(self, budget) -> int:
        """Entries of the budget's M whose bytes go to the archive; a layer given a small M (layer_budget)
        keeps at least one entry beyond its sink."""
        if self.evicted_bits is None:
            return 0
        return min(self._share(budget.max_kv_size), budget.max_kv_size - budget.sink - 1)

    def _share(self, M: int) -> int:
        return int(round(self.evicted_share * M))

    def split(self, budget, storage, head_dims, itemsize: int):
        """(the budget in force, the archive's size in entries): of the bytes of the budget's M entries
        in the storage's own format, the archive's share buys entries at `evicted_bits`."""
        moved = self.moved(budget)
        if not moved:
            return budget, 0
        dims = (*head_dims, storage.group_size, itemsize)
        own, low = (row_bytes(f, *dims) + BOOKKEEPING_BYTES for f in (storage.tiers()[0], self.archive_format))
        return budget.for_layer(budget.max_kv_size - moved), moved * own // low

    # ------------------------------------------------------------------ an eviction
    def evict(self, lane: Lane, idx: mx.array, keep: int, recent: int, capacity: int, rule, offset: int, scoreless: bool):
        """Compact `lane` to its entries idx[..., :keep] (ascending), in buffers of `capacity` rows,
        after doing with the others what this keeper does (a cache that saw no scores only drops)."""
        kept_idx = idx[..., :keep]
        # (Per-head budgets: one head may keep every entry while the others give up more.)
        drops = not scoreless and keep < lane.length
        if drops and self.merge is not None:
            self._merge(lane, kept_idx, keep)
        elif drops and self.evicted_bits is not None:
            self._archive(lane, kept_idx, keep, rule, offset)
        # (the eviction plan's idx comes padded to `capacity` with zeros already: slicing and padding it
        # again would be 4 primitives more)
        padded = idx if idx.shape[2] == capacity else pad_indices(kept_idx, capacity)
        lane.store.gather(padded, keep, recent, capacity)

    def _merge(self, lane: Lane, kept_idx: mx.array, keep: int):
        """Fold the entries about to be evicted into their most similar kept entries (merge_evicted),
        rewriting those rows and their columns before the gather."""
        store = lane.store
        keys, values = store.read_rows()
        kept = _kept_mask(store.length, kept_idx)
        target, k, v, mult, acc = merge_evicted(keys, values, kept, keep, store.column("mult"), store.column("acc"), self.merge)
        store.write_rows(target, k, v)
        store.write_column_at("mult", target, mult)
        store.write_column_at("acc", target, acc)

    def _archive(self, lane: Lane, kept_idx: mx.array, keep: int, rule, offset: int):
        """Move the entries not kept to the archive; over its size, it drops its lowest priorities."""
        store, archive = lane.store, lane.archive
        n = store.length
        dropped = mx.argsort(_kept_mask(n, kept_idx).astype(mx.int32), axis=-1)[..., : n - keep]  # not kept sort first
        keys, values = store.read_rows()
        acc, pos = take_rows([store.column("acc"), store.column("pos")], dropped)
        dtype = getattr(mx, lane.row_dtype)
        A = lane.archive_size
        # Room for its size and one eviction's rows, stated: growing in GROW_STEP rows would reserve
        # more than a byte budget counts (bytes.py).
        keys, values = take_rows([keys, values], dropped)
        archive.append(keys.astype(dtype), values.astype(dtype), A + n - keep, acc=acc, pos=pos)
        # Written now, not when next read: the gathered scores and positions would wait beside the
        # column buffers the byte budget counts, one eviction's more at each, until the archive fills.
        archive.written_columns()
        if archive.length > A:
            priority = rule.priority(archive.column("acc"), archive.column("pos"), offset)
            # Room for the next eviction's rows, so appending does not reallocate.
            idx = select_entries(priority, mx.zeros(priority.shape, mx.bool_), A, False, capacity=A + n - keep)
            archive.gather(idx, A, 0, A + n - keep)


def _kept_mask(n: int, kept_idx: mx.array) -> mx.array:
    """(B, H, n) bool: the entries kept_idx (B, H, keep) names."""
    return (mx.arange(n)[None, None, :, None] == kept_idx[:, :, None, :]).any(axis=-1)


def merge_evicted(keys, values, kept, n_kept: int, mult, acc, threshold: float):
    """Keep, don't drop (CaM / D2O-style): each evicted entry whose key is within cosine similarity
    `threshold` (unit_centred) of a kept entry's is folded into the most similar kept entry: keys and
    values become the multiplicity-weighted means, multiplicities and score accumulators add up. The
    merged entry then stands for all its tokens: attention adds log(multiplicity) to its logit, so
    where keys coincide it receives the attention they all would have (token merging's proportional
    attention).

    keys, values (B, H, N, D) float32; kept (B, H, N) bool, n_kept True per (b, h); mult, acc
    (B, H, N). Returns (target
    (B, H, E) index of each evicted entry's merge target, and the new keys, values, mult, acc of
    those targets, each (B, H, E, ...)): rows of unmerged evictions come back unchanged, and several
    evicted entries sharing a target carry the same final row."""
    B, H, N, D = keys.shape
    unit = unit_centred(keys)
    sim = unit @ unit.swapaxes(-1, -2)  # (B, H, N, N)
    sim = mx.where(kept[:, :, None, :], sim, -mx.inf)
    best = mx.argmax(sim, axis=-1)  # (B, H, N): most similar kept entry
    best_sim = mx.take_along_axis(sim, best[..., None], axis=-1)[..., 0]
    merges = (~kept) & (best_sim >= threshold)
    # A[e, r] = 1 where evicted e folds into kept r.
    assign = (mx.arange(N)[None, None, None, :] == best[..., None]) & merges[..., None]
    w = mult.astype(mx.float32)
    into = assign.swapaxes(-1, -2).astype(mx.float32)  # (B, H, r, e)
    add_w = (into @ w[..., None])[..., 0]
    total = w + add_w
    new_k = (w[..., None] * keys + into @ (w[..., None] * keys)) / total[..., None]
    new_v = (w[..., None] * values + into @ (w[..., None] * values)) / total[..., None]
    new_acc = acc + (into @ acc[..., None])[..., 0]
    evicted = mx.argsort(kept.astype(mx.int32), axis=-1)[..., : N - n_kept]  # the evicted entries (kept sort last)
    target = mx.take_along_axis(best, evicted, axis=-1)
    return target, *take_rows([new_k, new_v, total, new_acc], target)
