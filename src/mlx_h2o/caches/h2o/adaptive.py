"""`AdaptiveHeadsKVCache`: the h2o cache with one heavy-hitter budget per layer shared by its kv
heads (`head_budget="adaptive"`, Ada-KV; selection rule in budgets.py).

Heads then hold different numbers of entries, and nothing is padded where it costs:
- K/V rows live in `storage.PerHeadKV`: one storage per (batch row, kv head), each grown and
  compacted to exactly its own rows (plus `evict_every` spare, as the uniform cache has);
- attention runs the fused kernel once per (batch row, kv head) over that head's segments, with the
  head's query group (GQA) and sinks: no padded row is stored or read, and no kernel change is
  needed (the price: B x H kernel calls per layer instead of one);
- the per-entry bookkeeping (score accumulator, position: 8 bytes an entry against 2 x D x 4 bytes
  of fp32 K/V) stays a (B, H, C) rectangle with C = the longest head, so eviction remains one
  vectorised plan; slots past a head's length hold position PAD and score 0.

The layer holds the same total as the uniform cache: every batch row keeps H x keep entries at an
eviction, so `length` (the mean per head) follows the uniform cache's schedule exactly.
"""

import mlx.core as mx
import numpy as np

from ...attention import attention_with_scores
from ...storage import PerHeadKV, gather_rows
from .budgets import adaptive_head_selection
from .cache import H2OKVCache, make_storage
from .eviction import entry_priority, keep_count, recent_kept

PAD = np.iinfo(np.int32).max  # position of an empty bookkeeping slot


class AdaptiveHeadsKVCache(H2OKVCache):
    """h2o with per-head budgets (see the module docstring)."""

    def reset(self):
        super().reset()
        self.store = PerHeadKV(lambda: make_storage(self.config, self.seed))
        self.head_lengths = None  # (B, H) NumPy: entries per head

    @property
    def nbytes(self):
        n = 0 if self.head_lengths is None else int(self.head_lengths.sum())
        return self.store.nbytes() + n * 8  # + one float32 score and one int32 position per entry

    def make_mask(self, N, return_array=False, window_size=None):
        if return_array and N > 1 and not self._heads_aligned(N):
            raise ValueError("head_budget='adaptive' keeps different entries per head: no single mask array; use 'causal'")
        return super().make_mask(N, return_array, window_size)

    def _heads_aligned(self, L: int) -> bool:
        """Whether every head will hold the same number of entries when the next L tokens attend
        (before any eviction: then one mask array serves all heads)."""
        if self.acc is None:
            return True
        uniform = len(set(self.head_lengths.ravel().tolist())) == 1
        return uniform and keep_count(self.config, self.length, self.offset, L) is None

    def trim(self, n):
        """Drop the last n tokens: as many as every head holds as its consecutive newest run."""
        n = min(n, self.length)
        if n <= 0:
            return 0
        pos = np.array(self.positions)
        ok = n
        for (b, h), m in np.ndenumerate(self.head_lengths):
            tail = pos[b, h, m - n : m][::-1]
            run = tail == np.arange(self.offset - 1, self.offset - 1 - n, -1)
            ok = min(ok, n if run.all() else int(np.argmin(run)))
        if ok:
            self.store.trim(ok)
            self.head_lengths -= ok
            cols = mx.arange(self.positions.shape[2])[None, None, :]
            live = cols < mx.array(self.head_lengths)[..., None]
            self.positions = mx.where(live, self.positions, PAD)
            self.acc = mx.where(live, self.acc, 0.0)
            self.length -= ok
            self.offset -= ok
        return ok

    def _payload(self):
        out = super()._payload()
        if out is not None:
            C = int(self.head_lengths.max())
            out.update(acc=self.acc[..., :C], positions=self.positions[..., :C], head_lengths=mx.array(self.head_lengths))
        return out

    def _restore(self, payload, meta):
        super()._restore(payload, meta)
        if payload is not None:
            self.head_lengths = np.array(payload["head_lengths"]).astype(np.int64)

    # ------------------------------------------------------------------ storage and bookkeeping
    def _append(self, keys, values):
        B, H, L, _ = keys.shape
        if self.head_lengths is None:
            self.head_lengths = np.zeros((B, H), np.int64)
        n = self.head_lengths
        need = int(n.max()) + L
        if self.acc is None or need > self.acc.shape[2]:
            grow = need - (0 if self.acc is None else self.acc.shape[2])
            self.acc = _widen(self.acc, B, H, grow, 0.0, mx.float32)
            self.positions = _widen(self.positions, B, H, grow, PAD, mx.int32)
        C = self.acc.shape[2]
        cols = (mx.array(n, mx.int32)[..., None] + mx.arange(L, dtype=mx.int32)).reshape(B, H, L)
        flat = (cols + (mx.arange(B * H, dtype=mx.int32) * C).reshape(B, H, 1)).reshape(-1)
        acc, pos = self.acc.reshape(-1), self.positions.reshape(-1)
        acc[flat] = mx.zeros((B * H * L,), mx.float32)
        pos[flat] = mx.broadcast_to(mx.arange(self.offset, self.offset + L, dtype=mx.int32), (B, H, L)).reshape(-1)
        self.acc, self.positions = acc.reshape(B, H, C), pos.reshape(B, H, C)
        # Each head's rows: room for its next evict_every appends, as the uniform cache's steady state.
        self.store.append(keys, values, None)
        self.head_lengths = n + L
        return self.store, None

    def _evict(self, keep: int, capacity: int):
        cfg = self.config
        B, H, C = self.acc.shape
        cols = mx.arange(C)[None, None, :]
        valid = cols < mx.array(self.head_lengths)[..., None]
        recent = recent_kept(cfg, self.offset, keep)
        if self.scoreless:
            priority = self.positions.astype(mx.float32)
        else:
            priority = entry_priority(cfg, self.rule, self.acc, self.positions, self.offset)
        protected = (self.positions < cfg.sink) | ((self.positions >= self.offset - recent) & valid)
        pinned = cfg.pinned_mask(self.positions)
        if pinned is not None:
            protected = protected | pinned
        kept = adaptive_head_selection(priority, protected, valid, H * keep, cfg.heavy)
        counts = np.array(kept.sum(axis=-1)).astype(np.int64)
        order = mx.argsort(mx.where(kept, cols, C + cols), axis=-1)  # kept slots first, in position order
        width = int(counts.max()) + cfg.evict_every
        idx = order[..., : min(width, C)]
        if width > C:
            idx = mx.concatenate([idx, mx.zeros((B, H, width - C), idx.dtype)], axis=-1)
        live = mx.arange(width)[None, None, :] < mx.array(counts)[..., None]
        self.acc = mx.where(live, gather_rows(self.acc, idx), 0.0)
        self.positions = mx.where(live, gather_rows(self.positions, idx), PAD)
        self.store.gather_heads(idx, counts, recent, cfg.evict_every)
        self.head_lengths = counts
        self.length = keep
        self.evictions += 1

    # ------------------------------------------------------------------ attention per head
    def _attention(self, queries, keys, values, scale, mask, sinks):
        if isinstance(mask, mx.array) and len(set(self.head_lengths.ravel().tolist())) > 1:
            raise ValueError("head_budget='adaptive' attends each head over its own entries: the mask must be None or 'causal'")
        B, Hq, L, _ = queries.shape
        H = self.head_lengths.shape[1]
        G = Hq // H
        C = self.acc.shape[2]
        outs, stats, raws = [], [], []
        for b in range(B):
            row_out, row_stats, row_raw = [], [], []
            for h in range(H):
                q = queries[b : b + 1, h * G : (h + 1) * G]
                s = None if sinks is None else sinks[h * G : (h + 1) * G]
                out, raw = attention_with_scores(q, self.store.head_segments(b, h), scale=scale, mask=mask,
                                                 scores=self.rule.op_scores, sinks=s)
                row_out.append(out)
                pad = C - int(self.head_lengths[b, h])
                st = self.rule.stats(raw, 1, L)
                row_stats.append(mx.pad(st, [(0, 0), (0, 0), (0, pad)]))
                if self.rule.op_scores == "mass":
                    row_raw.append(mx.pad(raw, [(0, 0), (0, 0), (0, pad)]))
            outs.append(mx.concatenate(row_out, axis=1))
            stats.append(mx.concatenate(row_stats, axis=1))
            raws.append(mx.concatenate(row_raw, axis=1) if row_raw else None)
        live = mx.array(self.head_lengths, mx.float32)[..., None] - (L - 1) / 2
        raw = mx.concatenate(raws, axis=0) if raws[0] is not None else None
        return mx.concatenate(outs, axis=0), raw, mx.concatenate(stats, axis=0), L, live


def _widen(a, B, H, extra, fill, dtype):
    fresh = mx.full((B, H, extra), fill, dtype)
    return fresh if a is None else mx.concatenate([a, fresh], axis=2)
