"""The full cache batched with the rows of a shared prefix held once.

mlx-lm's `BatchKVCache` joins a batch's sequences into one padded array. Requests forked from one
prompt-cache snapshot (mlx-lm's server deep-copies the snapshot of a shared system prompt for each)
then hold its rows once per request, plus padding: 8 requests behind a 1,000-token system prompt
added 9.9 snapshots (docs/mlx-lm.md). The full policy's caches (`FusedKVCache`, caches/baseline.py)
merge into a `SharedRowsBatch` instead:

- Each sequence is a `SharedRowsKVCache`: every token, in a copy-on-write `KVStore`
  (storage/kv.py) whose first rows are read in place from the cache it was made from (views of its
  buffers: nothing is copied). Copies share rows: the copies of one snapshot read its rows once.
- The batch holds one read-only **prefix**, the rows the sequences share (some may have none), and
  every sequence's other rows in one left-padded mlx-lm `BatchKVCache` (the **tails**). Attention is
  one fused call over [the prefix broadcast to the batch (a stride-0 view), the tails], the prefix
  masked for sequences without it. With no prefix this is mlx-lm's `BatchKVCache`, call for call.
- Sequences forked from different snapshots have no prefix in common: the batch then keeps each in
  its own cache (`SequenceBatch`, one fused call per sequence).

A `SharedRowsKVCache` is a full cache in its own right (trimmed, saved, loaded, copied with its rows
shared again), so the caches a batch hands back (`extract`, which mlx-lm's server keeps as the next
snapshot) work wherever a `KVCache` does.

Models that read the fetched rows before attending (MLA's latents, gemma2's inline attention) get
them joined: one array per call, shared rows included (`passes_rows`, learnt from the first call).
"""

import copy
from typing import List, Optional

import mlx.core as mx
from mlx_lm.models import cache as lm_cache

from .. import hook
from ..attention import attention_with_scores
from ..storage import KVStore
from ..storage.kv import SHARED_TAIL_STEP
from .base import FusedAttention, SavedCache, fetched_ids, handed_on
from .batch import SequenceBatch


def attend_segments(cache, queries, segments, *, scale, mask, sinks):
    """Attention over (k, v) segments in row order: the fused op (composed MLX ops off the CPU), or
    mlx-lm's attention over them joined after `use_fast_cpu_attention(False)`."""
    if hook.baseline_attention_fused():
        return attention_with_scores(queries, segments, scale=scale, mask=mask, scores=None, sinks=sinks)[0]
    keys, values = (mx.concatenate([segment[i] for segment in segments], axis=2) for i in (0, 1))
    return hook.mlx_lm_attention(queries, keys, values, cache, scale, mask, sinks)


class SharedRowsKVCache(FusedAttention, SavedCache):
    """Every token of one sequence, in rows its copies share (see the module docstring)."""

    def __init__(self):
        self.rows = KVStore()
        # Whether the model hands the fetched rows to attention untouched (mlx-lm's attention), so
        # that they may come as segments: None until a call shows it, and until then they come joined.
        self.passes_rows, self._fetched_id = None, None

    @classmethod
    def of(cls, cache) -> "SharedRowsKVCache":
        """`cache` itself if it is one, else a SharedRowsKVCache reading an mlx-lm `KVCache`'s rows
        in place."""
        if isinstance(cache, cls):
            return cache
        if not isinstance(cache, lm_cache.KVCache):
            raise ValueError(f"a {cls.__name__} is made from an mlx-lm KVCache, not a {type(cache).__name__}")
        out = cls()
        out.passes_rows = getattr(cache, "passes_rows", None)  # (FusedKVCache learns it too)
        if cache.keys is not None and cache.offset:
            if cache.keys.shape[0] != 1:
                raise ValueError("full caches merge into a batch only from single-sequence caches")
            # FusedKVCache: one piece for it and all its copies, so that their batch groups them
            piece = cache.shared_rows() if hasattr(cache, "shared_rows") else rows_piece(cache)
            out.rows = KVStore.reading(None, None, after=[piece])
        return out

    @classmethod
    def merge(cls, caches):
        """mlx-lm's BatchGenerator: the sequences' caches of this layer as one SharedRowsBatch."""
        return SharedRowsBatch.merge(caches)

    @property
    def offset(self) -> int:
        return self.rows.length

    def update_and_fetch(self, keys, values):
        self.rows.append(keys, values)
        if not self.passes_rows and self.rows.shared_length:
            fetched = self.rows.joined()  # a transient copy; the prefix stays shared
        else:
            fetched = self.rows.fetch()  # arrays, or the segments (shared prefix, own rows) and None
        self._fetched_id = fetched_ids(fetched)
        return fetched

    def attend(self, queries, keys, values, *, scale, mask=None, sinks=None):
        if self.passes_rows is None:
            self.passes_rows = handed_on(self._fetched_id, keys, values)
        if isinstance(keys, list):
            return attend_segments(self, queries, keys, scale=scale, mask=mask, sinks=sinks)
        return super().attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks)

    # KVCache's mask reads `offset` only.
    make_mask = lm_cache.KVCache.make_mask

    def size(self):
        return self.offset

    def empty(self):
        return self.offset == 0

    @property
    def nbytes(self):
        return self.rows.nbytes()

    def is_trimmable(self):
        return True

    def trim(self, n):
        n = min(self.offset, n)
        self.rows.trim(n)
        return n

    def _payload(self):
        return self.rows.state()

    def _meta(self):
        return {}

    def _restore(self, payload, meta):
        self.__init__()
        self.rows.load(payload)


def rows_piece(cache: lm_cache.KVCache) -> KVStore:
    """An mlx-lm KVCache's rows as a read-only store (views of its buffers)."""
    n = cache.offset
    return KVStore.reading(cache.keys[:, :, :n], cache.values[:, :, :n]).shared[0]


def _passes_rows(caches) -> Optional[bool]:
    """What the sequences have learnt of the model (they share it): True if any saw the rows passed
    on, False if one saw them read, None before any call."""
    known = {c.passes_rows for c in caches} - {None}
    return True if True in known else (False if known else None)


def _kv_cache(rows) -> lm_cache.KVCache:
    """An mlx-lm KVCache holding (keys, values) rows as they are (None: empty)."""
    cache = lm_cache.KVCache()
    if rows is not None:
        cache.keys, cache.values = rows
        cache.offset = rows[0].shape[2]
    return cache


class TailsKVCache(lm_cache.BatchKVCache):
    """mlx-lm's BatchKVCache growing in SHARED_TAIL_STEP rows: the rows after a shared prefix are a
    question and an answer, and 256 rows of room in each of N sequences would outweigh the rows
    they share."""

    step = SHARED_TAIL_STEP


class SharedRowsBatch(SequenceBatch):
    """One layer of a batch of full-cache sequences: a shared prefix and left-padded tails, or one
    cache per sequence (see the module docstring)."""

    def __init__(self, caches: List[SharedRowsKVCache]):
        super().__init__(caches)
        self.tails: Optional[TailsKVCache] = None  # grouped: the rows after the prefix
        self.prefix: List[KVStore] = []  # grouped: the shared pieces (read-only stores)
        self.with_prefix: List[bool] = []  # grouped: which sequences have it
        self._segments: list = []  # grouped: the prefix's (k, v) views
        self._passes, self._fetched_id = None, None
        self._group()

    def __deepcopy__(self, memo):
        # (BatchGenerator copies a batch to split it.) The prefix is read-only: the copy reads the
        # same pieces, so the two halves still group when they are joined again.
        twin = type(self).__new__(type(self))
        memo[id(self)] = twin
        read_only = ("prefix", "_segments")
        twin.__dict__.update({k: copy.deepcopy(v, memo) for k, v in self.__dict__.items() if k not in read_only})
        twin.prefix, twin._segments = list(self.prefix), list(self._segments)
        return twin

    @classmethod
    def merge(cls, caches):
        sequences = []
        for c in caches:
            sequences += c.sequences() if isinstance(c, cls) else [SharedRowsKVCache.of(c)]
        return cls(sequences)

    # ------------------------------------------------------------------ layout
    @property
    def grouped(self) -> bool:
        return self.tails is not None

    def _group(self) -> None:
        """Take the grouped layout when the sequences share one prefix (or none)."""
        prefixes = {tuple(map(id, c.rows.shared)): c.rows.shared for c in self.caches if c.rows.shared}
        if len(prefixes) > 1:
            return  # copies of different snapshots: one cache per sequence
        self.prefix = list(next(iter(prefixes.values()), []))
        self.with_prefix = [bool(c.rows.shared) for c in self.caches]
        own = [c.rows.own() for c in self.caches]
        # (BatchKVCache.merge makes a plain BatchKVCache when no sequence has rows)
        self.tails = TailsKVCache.merge([_kv_cache(rows) for rows in own]) if any(own) else TailsKVCache([0] * len(own))
        self._passes = _passes_rows(self.caches)
        self._segments = [segment for piece in self.prefix for segment in piece.segments()]
        self.caches = []

    def sequences(self) -> List[SharedRowsKVCache]:
        """Each sequence as its own SharedRowsKVCache (its rows read in place, its tail copied)."""
        if not self.grouped:
            return list(self.caches)
        return [self._sequence(i) for i in range(len(self.with_prefix))]

    def _sequence(self, i: int) -> SharedRowsKVCache:
        own = self.tails.extract(i) if self.tails.keys is not None else _kv_cache(None)
        c = SharedRowsKVCache()
        own_rows = (own.keys, own.values) if own.offset else (None, None)
        c.rows = KVStore.reading(*own_rows, after=self.prefix if self.with_prefix[i] else [])
        c.passes_rows = self._passes
        return c

    def _ungroup(self) -> None:
        if self.grouped:
            self.caches, self.tails, self.prefix, self.with_prefix = self.sequences(), None, [], []

    # ------------------------------------------------------------------ batch protocol
    @property
    def offset(self):
        if not self.grouped:
            return super().offset
        if not self.prefix:
            return self.tails.offset
        return self.tails.offset + mx.array(self._prefix_lengths())

    @property
    def _prefix_length(self) -> int:
        return sum(piece.length for piece in self.prefix)

    def _prefix_lengths(self) -> List[int]:
        n = self._prefix_length
        return [n if has else 0 for has in self.with_prefix]

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        if not self.grouped:
            return super().prepare(left_padding=left_padding, lengths=lengths, right_padding=right_padding)
        self.tails.prepare(left_padding=left_padding, lengths=lengths, right_padding=right_padding)

    def finalize(self):
        return self.tails.finalize() if self.grouped else super().finalize()

    def filter(self, batch_indices):
        if not self.grouped:
            return super().filter(batch_indices)
        self.tails.filter(batch_indices)
        self.with_prefix = [self.with_prefix[i] for i in batch_indices]
        if not any(self.with_prefix):  # the last sequence that read it is gone
            self.prefix, self._segments = [], []

    def extend(self, other):
        if self.grouped and other.grouped and (not self.prefix or not other.prefix or self._same_prefix(other)):
            if not self.prefix:
                self.prefix, self._segments = other.prefix, other._segments
            self.tails.extend(other.tails)
            self.with_prefix += other.with_prefix
            self._passes = self._passes if self._passes is not None else other._passes
            return
        self._ungroup()
        self.caches += other.sequences()

    def _same_prefix(self, other) -> bool:
        return list(map(id, self.prefix)) == list(map(id, other.prefix))

    def extract(self, idx):
        return self._sequence(idx) if self.grouped else super().extract(idx)

    def size(self):
        return self._prefix_length + self.tails.size() if self.grouped else super().size()

    def empty(self):
        return (not self.prefix and self.tails.empty()) if self.grouped else super().empty()

    @property
    def nbytes(self):
        if not self.grouped:
            return super().nbytes
        return sum(piece.nbytes() for piece in self.prefix) + self.tails.nbytes

    @property
    def state(self):
        return self.tails.state if self.grouped else super().state

    @state.setter
    def state(self, value):
        SequenceBatch.state.fset(self, value)

    # ------------------------------------------------------------------ the layer's calls
    @property
    def passes_rows(self) -> Optional[bool]:
        return self._passes if self.grouped else _passes_rows(self.caches)

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        if self.grouped:
            return self._grouped_mask(N, return_array, window_size)
        if self.passes_rows:
            return super().make_mask(N, return_array, window_size)
        return self._padded_mask(N, window_size)

    def _grouped_mask(self, N, return_array, window_size):
        if window_size is not None and self.prefix:
            raise ValueError("a batch with a shared prefix cannot serve a sliding-window mask")
        mask = self.tails.make_mask(N, return_array=return_array, window_size=window_size)  # (B, 1, N, tails)
        if not self.prefix:
            return mask
        P = self._prefix_length
        mask = mx.broadcast_to(mask, (len(self.with_prefix), 1, *mask.shape[-2:]))
        visible = mx.broadcast_to(mx.array(self.with_prefix)[:, None, None, None], (mask.shape[0], 1, N, P))
        return mx.concatenate([visible, mask], axis=-1)

    def _padded_mask(self, N, window_size):
        # One right-padded array per call (update_and_fetch): sequence b's rows end at offsets[b] +
        # rows[b]; its padding rows in the call repeat its last query's position (outputs mlx-lm
        # never reads).
        offsets = mx.array([c.offset for c in self.caches])
        rows = mx.array(self.rows_of_call(N))
        width = max(c.offset + n for c, n in zip(self.caches, self.rows_of_call(N)))
        queries = offsets[:, None] + mx.minimum(mx.arange(N)[None], mx.maximum(rows - 1, 0)[:, None])
        keys = mx.arange(max(width, 1))[None, None]
        mask = keys <= queries[..., None]
        if window_size is not None:
            mask = mask & (keys > queries[..., None] - window_size)
        return mask[:, None]  # (B, 1, N, keys)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if self.grouped:
            fetched = self.tails.update_and_fetch(keys, values)
            if self.prefix:
                B = keys.shape[0]
                segments = [tuple(mx.broadcast_to(x, (B, *x.shape[1:])) for x in seg) for seg in self._segments]
                segments.append(fetched)
                if self._passes:
                    fetched = segments, None
                else:
                    fetched = tuple(mx.concatenate([seg[i] for seg in segments], axis=2) for i in (0, 1))
        else:
            fetched = super().update_and_fetch(keys, values)
            if not self.passes_rows:
                fetched = self._padded_rows(keys, values)
        self._fetched_id = fetched_ids(fetched)
        return fetched

    def _padded_rows(self, keys, values):
        width = max(c.offset for c in self.caches)
        joined = [c.rows.joined() if c.offset else None for c in self.caches]  # (each pair once)
        padded = []
        for x, role in ((keys, 0), (values, 1)):
            parts = []
            for rows in joined:
                rows = rows[role] if rows is not None else mx.zeros((1, x.shape[1], 0, x.shape[3]), x.dtype)
                parts.append(mx.pad(rows, [(0, 0), (0, 0), (0, width - rows.shape[2]), (0, 0)]))
            padded.append(mx.concatenate(parts, axis=0))
        return tuple(padded)

    def attend(self, queries, keys, values, *, scale, mask=None, sinks=None):
        if isinstance(keys, list):
            if self.grouped:  # the prefix and the tails: one fused call
                return attend_segments(self, queries, keys, scale=scale, mask=mask, sinks=sinks)
            return super().attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks)  # each sequence's
        if self.passes_rows is None:
            passes = handed_on(self._fetched_id, keys, values)
            if self.grouped:
                self._passes = passes
            for c in self.caches:
                c.passes_rows = passes
        return FusedAttention.attend(self, queries, keys, values, scale=scale, mask=mask, sinks=sinks)
