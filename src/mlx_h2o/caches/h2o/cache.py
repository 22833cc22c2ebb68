"""`H2OKVCache`: the heavy-hitter cache of one layer.

Per kv head the cache keeps M = sink + heavy + recent entries: the first `sink` tokens, the `heavy`
highest-priority middle tokens and the `recent` last tokens, plus any pinned spans (outside M).
Priorities come from the attention each entry received, reported by the fused kernel's score
export and folded in by a scoring rule (scoring.py); which entries go is planned in eviction.py;
K/V rows live in storage (storage/: dense, packed, tiered, rotated).

How it fits mlx-lm without model edits:
- Models reach attention through `mlx_lm.models.base.scaled_dot_product_attention`, which hands the
  call to `attend` (caches/base.py), where the op runs with scores and the rule accumulates them.
- `offset` counts the tokens processed (RoPE positions, masks); `length` is what is stored. They
  differ once anything is evicted, and the model never sees `length` as a position (resetting
  `offset` after eviction was the MLX seed's garbage-output bug).
- Eviction happens at the start of `update_and_fetch`, before the new tokens are appended, from the
  scores gathered so far; `make_mask` plans the same eviction, so the mask built before the layer
  runs matches the evicted layout. Rows stay in position order and new tokens are appended at the
  end, so the ordinary causal mask is right for the evicted layout.
- Models whose attention bypasses mlx-lm's function (mlx-lm's gemma2 computes soft-capped attention
  inline) give no scores: the cache notices, warns once and keeps sink + the most recent entries.
"""

import warnings
from typing import Optional

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import create_causal_mask

from ...attention import attention_with_scores
from ...storage import KVStorage, RotatedKV, check_group_size, gather_rows, make_kv_storage
from ..base import AttendingCache
from .budgets import LayerBudgetGroup, attention_entropy
from .eviction import buffer_capacity, eviction_plan, keep_count, merge_evicted, recent_kept, uses_keys
from .options import H2OConfig
from .scoring import make_rule, max_pool


# Per query row, the weight the running query statistics keep (about the last 20 rows): recent
# queries, whose RoPE phases are close to the next ones'.
QUERY_DECAY = 0.95


def make_storage(config: H2OConfig, seed: int) -> KVStorage:
    """K/V rows as the config says: one format or older/recent tiers, rotated or not."""
    older, recent = config.tiers()
    store = make_kv_storage(older, recent, config.recent, config.kv_group_size)
    return RotatedKV(store, seed, config.rotate_lam) if config.rotate else store


class H2OKVCache(AttendingCache):
    """Sink + heavy hitters + recent window, per kv head; see the module docstring."""

    def __init__(self, config: H2OConfig, seed: int = 0):
        self.config = config  # this layer's: M may differ from the policy's (layer_budget, budgets.py)
        self.seed = seed  # of this layer's rotation (rotate=True)
        # layer_budget="dispersion": the model's caches share a group that fixes every layer's M
        # when the first one fills (budgets.py); a loaded cache keeps the budget it was saved with.
        self.budget_group: Optional[LayerBudgetGroup] = None
        self.budget_index = 0
        self.budget_allocated = config.layer_budget != "dispersion"
        self.rule = make_rule(config.score, config.decay)
        self.reset()

    def reset(self):
        """Forget everything (an independent generation starts from scratch)."""
        self.store = make_storage(self.config, self.seed)  # K/V rows, position order
        self.acc = self.positions = None  # (B, H, capacity): score accumulator, token position
        self.mult = None  # (B, H, capacity): tokens an entry stands for (merge; None when merge is off)
        self.offset = 0  # tokens processed: RoPE position of the next token
        self.length = 0  # entries held
        self.peak = 0  # most entries ever held at once (bound: M + pinned, or a prefill chunk past it)
        self.evictions = 0
        self.scoreless = False
        self._awaiting_scores = False
        # Running mean and mean square of the (storage-space) queries per query head, and the
        # attention scale: what expected attention (`expected`) predicts future queries from.
        self.q_mean = self.q_sq = None
        self.scale = None

    # ------------------------------------------------------------------ mlx-lm's protocol
    def size(self):
        return self.length

    def empty(self):
        return self.acc is None

    @property
    def nbytes(self):
        # Stored K/V rows plus the per-entry score and position bookkeeping.
        n = self.length
        return self.store.nbytes() + sum(a[..., :n].nbytes for a in (self.acc, self.positions, self.mult) if a is not None)

    def is_trimmable(self):
        return True

    def trim(self, n):
        """Drop the last n tokens (speculative decoding). Only tokens still held can go: the trailing
        run of consecutive positions (at least the recent window)."""
        n = min(n, self.length)
        if n <= 0:
            return 0
        # Positions are ascending per head: the held tail is a consecutive run ending at offset - 1.
        tail = np.array(self.positions[..., self.length - n : self.length])
        run = (tail == np.arange(self.offset - n, self.offset)).all(axis=(0, 1))[::-1]
        n = int(n if run.all() else np.argmin(run))
        self.store.trim(n)
        self.length -= n
        self.offset -= n
        return n

    def _payload(self):
        if self.acc is None:
            return None
        n = self.length
        queries = None if self.q_mean is None else {"mean": self.q_mean, "square": self.q_sq}
        mult = None if self.mult is None else self.mult[..., :n]
        return {"rows": self.store.state(), "acc": self.acc[..., :n], "positions": self.positions[..., :n], "queries": queries,
                "mult": mult}

    def _meta(self):
        return {"config": self.config.to_json(), "seed": self.seed, "offset": self.offset, "length": self.length,
                "peak": self.peak, "evictions": self.evictions, "scoreless": self.scoreless, "scale": self.scale,
                "budget_allocated": self.budget_allocated}

    def _restore(self, payload, meta):
        self.__init__(H2OConfig.from_json(meta["config"]), meta["seed"])
        if payload is not None:
            self.store.load(payload["rows"])
            self.acc, self.positions = payload["acc"], payload["positions"]
            self.mult = payload.get("mult")
            if payload.get("queries") is not None:
                self.q_mean, self.q_sq = payload["queries"]["mean"], payload["queries"]["square"]
        self.scale = meta.get("scale")
        self.budget_allocated = meta.get("budget_allocated", True)
        self.offset, self.length, self.peak = meta["offset"], meta["length"], meta["peak"]
        self.evictions, self.scoreless = meta["evictions"], meta["scoreless"]

    @classmethod
    def merge(cls, caches):
        """mlx-lm's BatchGenerator: several sequences' caches of this layer as one batch cache,
        each sequence still evicted on its own (batch.py)."""
        from .batch import BatchH2OKVCache

        return BatchH2OKVCache.merge(caches)

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        if window_size is not None and self.offset + N > window_size:
            raise ValueError(
                "an h2o layer cannot serve a sliding-window mask (its entries differ per layer and head); "
                "sliding-window layers keep their own cache"
            )
        if N == 1:
            return None  # a single query sees every held entry
        self._allocate_budgets(N)
        if return_array:
            keep = keep_count(self.config, self.length, self.offset, N)
            return create_causal_mask(N, self.length if keep is None else keep)
        return "causal"

    # ------------------------------------------------------------------ the layer's calls
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if self._awaiting_scores:
            self._lost_scores()
        B, H, L, _ = keys.shape
        if self.acc is not None and (B, H) != tuple(self.acc.shape[:2]):
            raise ValueError(f"keys have batch/heads {(B, H)} but the cache holds {tuple(self.acc.shape[:2])}; reset() it first")
        if self.acc is None and self.config.kv_bits is not None:
            for x in (keys, values):
                check_group_size("kv_group_size", self.config.kv_group_size, x.shape[-1])
        self._allocate_budgets(L)
        keep = keep_count(self.config, self.length, self.offset, L) if self.acc is not None else None
        if keep is not None:
            self._evict(keep, buffer_capacity(self.config, self.offset, keep + L))
        out = self._append(keys, values)
        self.offset += L
        self.length += L
        self.peak = max(self.peak, self.length)
        self._awaiting_scores = True
        return out

    def _append(self, keys: mx.array, values: mx.array):
        """Store the new rows after the held ones, with fresh bookkeeping; what update_and_fetch returns."""
        B, H, L, _ = keys.shape
        P = self.length
        if self.acc is None or P + L > self.acc.shape[2]:
            self._grow(B, H, buffer_capacity(self.config, self.offset, P + L))
        self.store.append(keys, values, self.acc.shape[2])
        self.acc[..., P : P + L] = mx.zeros((B, H, L), mx.float32)
        if self.mult is not None:
            self.mult[..., P : P + L] = mx.ones((B, H, L), mx.float32)
        self.positions[..., P : P + L] = mx.broadcast_to(mx.arange(self.offset, self.offset + L, dtype=mx.int32), (B, H, L))
        return self.store.fetch()

    def _evict(self, keep: int, capacity: int):
        idx, recent = self._plan(keep, capacity)
        if self.mult is not None and not self.scoreless:
            self._merge(idx[..., :keep], keep)
        self._keep(idx, keep, recent, capacity)

    def _plan(self, keep: int, capacity: int):
        """(indices (B, H, capacity) of the entries to keep, first `keep` ascending, padded; the
        recent entries protected) from the compiled plan (eviction.eviction_plan)."""
        n = self.length
        plan = eviction_plan(self.config, self.scoreless)
        recent = recent_kept(self.config, self.offset, keep)
        offset, recent_from = mx.array(self.offset, mx.int32), mx.array(self.offset - recent, mx.int32)
        content = self._content() if uses_keys(self.config) and not self.scoreless else ()
        return plan(self.acc[..., :n], self.positions[..., :n], offset, recent_from, keep, capacity, *content), recent

    def _keep(self, idx: mx.array, keep: int, recent: int, capacity: int):
        """Compact rows and bookkeeping to the entries idx (padded to `capacity`) names."""
        self.store.gather(idx, keep, recent, capacity)
        self.acc, self.positions = gather_rows(self.acc, idx), gather_rows(self.positions, idx)
        if self.mult is not None:
            self.mult = gather_rows(self.mult, idx)
        self.length = keep
        self.evictions += 1

    def _merge(self, kept_idx: mx.array, keep: int):
        """merge: fold the entries about to be evicted into their most similar kept entries
        (eviction.merge_evicted), rewriting those rows and their bookkeeping before the gather."""
        n = self.length
        kept = (mx.arange(n)[None, None, :, None] == kept_idx[:, :, None, :]).any(axis=-1)
        keys, values = self.store.read_rows()
        target, k, v, mult, acc = merge_evicted(keys, values, kept, keep, self.mult[..., :n], self.acc[..., :n], self.config.merge)
        self.store.write_rows(target, k, v)
        B, H, C = self.acc.shape
        flat = (target + (mx.arange(B * H, dtype=target.dtype) * C).reshape(B, H, 1)).reshape(-1)
        for name, new in (("mult", mult), ("acc", acc)):
            a = getattr(self, name).reshape(-1)
            a[flat] = new.reshape(-1)
            setattr(self, name, a.reshape(B, H, C))

    def _allocate_budgets(self, L: int):
        """layer_budget="dispersion": when this layer is about to evict for the first time, fix every
        layer's budget from the entropies seen so far (all layers have seen the same tokens)."""
        g = self.budget_group
        if g is not None and not g.allocated and self.acc is not None and keep_count(self.config, self.length, self.offset, L) is not None:
            g.allocate()

    def _content(self):
        """What content-aware eviction reads (eviction.eviction_plan): the held keys, dense, and the
        running query statistics."""
        keys, _ = self.store.read_rows()
        if self.q_mean is None:  # no query seen (cannot happen once scores arrived): expected attention is flat
            B, H, _, D = keys.shape
            self.q_mean = self.q_sq = mx.zeros((B, H, D), mx.float32)
        var = mx.maximum(self.q_sq - self.q_mean * self.q_mean, 0.0)
        return keys, self.q_mean, var, mx.array(self.scale or 1.0, mx.float32)

    def _track_queries(self, queries: mx.array, scale: float):
        """Fold a call's query rows into the running query mean and mean square (EMA, QUERY_DECAY per row)."""
        L = queries.shape[2]
        q = queries.astype(mx.float32)
        mean, square = q.mean(axis=2), (q * q).mean(axis=2)
        if self.q_mean is None or self.q_mean.shape != mean.shape:
            self.q_mean, self.q_sq = mean, square
        else:
            d = QUERY_DECAY**L
            self.q_mean = d * self.q_mean + (1.0 - d) * mean
            self.q_sq = d * self.q_sq + (1.0 - d) * square
        self.scale = float(scale)

    def _grow(self, B, H, capacity):
        def grown(buf, dtype):
            fresh = mx.zeros((B, H, capacity - (0 if buf is None else self.length)), dtype)
            return fresh if buf is None else mx.concatenate([buf[:, :, : self.length], fresh], axis=2)

        self.acc = grown(self.acc, mx.float32)
        self.positions = grown(self.positions, mx.int32)
        if self.config.merge is not None:
            self.mult = grown(self.mult, mx.float32)

    def attend(self, queries, keys, values, *, scale, mask=None, sinks=None):
        """Attention for this layer, folding the scores into the cache."""
        dtype = queries.dtype
        queries = self.store.prepare_queries(queries)  # rotated storage: <R q, R k> = <q, k>
        if self.config.expected > 0:
            self._track_queries(queries, scale)
        out, raw, stats, rows, live = self._attention(queries, keys, values, scale, mask, sinks)
        if self.budget_group is not None and not self.budget_group.allocated:
            self.budget_group.observe(self.budget_index, attention_entropy(raw).item())
        n = stats.shape[-1]
        self.acc[..., :n] = self.rule.update(self.acc[..., :n], stats, rows, live)
        self._awaiting_scores = False
        return self.store.restore_output(out, dtype)

    def _attention(self, queries, keys, values, scale, mask, sinks, held=None):
        """The layer's attention over the held entries (`held` of them; default: length) -> (output,
        the op's raw scores, per-entry statistic (B, H, N) for the rule, the rows it stands for,
        mean entries a row attended)."""
        segments = keys if isinstance(keys, list) else [(keys, values)]
        N = sum((k.packed if hasattr(k, "packed") else k).shape[2] for k, _ in segments)
        held = self.length if held is None else held
        if N != held:
            raise ValueError(f"attention over {N} keys but the h2o cache holds {held}: keys must come from update_and_fetch")
        L = queries.shape[2]

        if self.mult is not None:
            mask = _with_log_multiplicity(mask, self.mult[..., :N], queries.shape[1], L)

        def op(q, mask, scores):
            return attention_with_scores(q, segments, scale=scale, mask=mask, scores=scores, sinks=sinks)

        w = self.config.obs_window
        if w and L > w:
            # Observation window (SnapKV): score the prompt by what its last w rows attend to, pooled
            # along positions, as if every row of the call attended that way.
            out, _ = op(queries, mask, None)
            _, raw = op(queries[:, :, -w:], _last_rows(mask, w, L), self.rule.op_scores)
            stats = max_pool(self.rule.stats(raw, self.acc.shape[1], w), self.config.obs_pool)
            live = N - (w - 1) / 2
        else:
            out, raw = op(queries, mask, self.rule.op_scores)
            stats = self.rule.stats(raw, self.acc.shape[1], L)
            live = N - (L - 1) / 2  # mean number of entries a row of the call attended (causal)
        return out, raw, stats, L, live

    def _lost_scores(self):
        if not self.scoreless:
            warnings.warn(
                "h2o: this model computes attention without mlx_lm.models.base.scaled_dot_product_attention "
                "(or the hook was removed), so the cache gets no attention scores; it keeps sink + recent "
                "entries instead (a sliding window)",
                RuntimeWarning,
                stacklevel=3,
            )
        self.scoreless = True


def _with_log_multiplicity(mask, mult: mx.array, Hq: int, L: int) -> mx.array:
    """The attention mask plus log(multiplicity) on each entry's logit (merge): an additive
    (B, Hq, L or 1, N) array."""
    B, H, N = mult.shape
    bias = mx.repeat(mx.log(mult), Hq // H, axis=1)[:, :, None, :]  # (B, Hq, 1, N)
    if mask is None:
        return bias
    if isinstance(mask, str):  # "causal": row i sits at N - L + i
        mask = mx.arange(N)[None, :] <= mx.arange(N - L, N)[:, None]
    if mask.dtype == mx.bool_:
        return mx.where(mask, bias, -mx.inf)
    return mask + bias


def _last_rows(mask, w: int, L: int):
    if mask is None or isinstance(mask, str):
        return mask  # "causal" puts row i at N - rows + i: right for the last w rows too
    if mask.ndim >= 2 and mask.shape[-2] == L:
        return mask[..., -w:, :]
    return mask
