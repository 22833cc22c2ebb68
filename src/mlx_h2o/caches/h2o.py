"""The "h2o" policy: a heavy-hitter KV cache (Zhang et al., 2023) for every mlx-lm model.

Per kv head the cache keeps M = sink + heavy + recent entries: the first `sink` tokens, the `heavy`
highest-priority middle tokens and the `recent` last tokens, plus any pinned spans (outside M).
Priorities come from the attention each entry received, reported by
`scaled_dot_product_attention_with_scores` and folded in by a scoring rule (caches/scoring.py).

How it fits mlx-lm without model edits:
- Models reach attention through `mlx_lm.models.base.scaled_dot_product_attention`; the hook
  (hook.py) sends it to `H2OKVCache.attend`, which runs the op with scores and accumulates them.
- `offset` counts the tokens processed (RoPE positions, masks); the physical length `length` is
  what is stored. They differ once anything is evicted, and the model never sees `length` as a
  position (resetting `offset` after eviction was the MLX seed's garbage-output bug).
- Eviction happens at the start of `update_and_fetch`, before the new tokens are appended, from the
  scores gathered so far; `make_mask` plans the same eviction, so the mask built before the layer
  runs matches the evicted layout. Physical order stays position order and new tokens are appended
  at the end, so the ordinary causal mask is right for the evicted layout.
- Amortised: the cache grows by up to `evict_every - 1` entries past M, then one gather brings it
  back (peak M + evict_every - 1). A call of L > 1 tokens (a prefill chunk) is appended whole and
  evicted before the next call, so a long prompt fed in chunks never holds more than M + chunk.
- Models whose attention bypasses the hook (mlx-lm's gemma2 computes soft-capped attention inline)
  give no scores: the cache notices, warns once and keeps sink + the most recent entries instead.
"""

import itertools
import json
import warnings
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as lm_cache
from mlx_lm.models.base import create_causal_mask

from .. import hook
from ..attention import attention_with_scores
from . import per_layer_caches, register_cache_class, register_policy
from .baseline import check_max_kv_size
from .kv_store import GROW_STEP, KVStore, TieredKV, gather_rows, pad_indices
from .rotation import DEFAULT_LAMBDA, LAMBDA_MODES, KVRotation
from .scoring import SCORE_RULES, make_rule, max_pool

SPLITS = ("heavy", "balanced", "recent", "explicit")
# Fraction of M given to heavy hitters by each preset; the rest after the sinks is the recent window.
SPLIT_HEAVY_FRACTION = {"heavy": 1 / 2, "balanced": 1 / 4, "recent": 1 / 8}
SELECTIONS = ("head", "layer")
DEFAULT_SCORE = "normalised"
DEFAULT_SPLIT = "heavy"
DEFAULT_EVICT_EVERY = 1
DEFAULT_SINK = 4
DEFAULT_OBS_POOL = 7
DEFAULT_KV_GROUP_SIZE = 32
KV_GROUP_SIZES = (32, 64, 128)
# "mixed" = older rows (sink + heavy hitters) at 4 bits, the recent window at 8: the newest rows take
# most of the attention, and a row is converted once, downwards, when it leaves the window.
KV_BITS = ("8", "4", "8/4", "4/8", "8/fp", "4/fp")
KV_BITS_ALIASES = {"mixed": "4/8", 8: "8", 4: "4"}


def _check_kv_bits(kv_bits) -> Optional[str]:
    if kv_bits is None:
        return None
    kv_bits = KV_BITS_ALIASES.get(kv_bits, kv_bits)
    if kv_bits not in KV_BITS:
        raise ValueError(f"kv_bits must be None, 8, 4, 'mixed' or one of {list(KV_BITS)} (heavy/recent), got {kv_bits!r}")
    return kv_bits


def _check_int(name, value, low, high=None):
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be an integer {bound}, got {value!r}")
    return value


def _check_spans(pin) -> Tuple[Tuple[int, int], ...]:
    """Pinned spans as sorted, merged, half-open (start, end) token ranges."""
    if pin is None:
        return ()
    if isinstance(pin, str):
        # "0:40;100:120" (the CLI and eval-spec form)
        try:
            pin = [tuple(int(x) for x in part.split(":")) for part in pin.replace(";", " ").split()]
        except ValueError:
            raise ValueError(f"pin must be START:END spans separated by ';', got {pin!r}") from None
    spans = []
    for span in pin:
        if (
            not isinstance(span, (tuple, list))
            or len(span) != 2
            or any(isinstance(v, bool) or not isinstance(v, int) for v in span)
            or not 0 <= span[0] < span[1]
        ):
            raise ValueError(f"pin must be (start, end) token ranges with 0 <= start < end, got {span!r}")
        spans.append((int(span[0]), int(span[1])))
    merged = []
    for s, e in sorted(spans):
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return tuple(merged)


@dataclass(frozen=True)
class H2OConfig:
    """Validated options of the h2o policy (what `make_cache(model, "h2o", ...)` takes)."""

    max_kv_size: int
    sink: int
    heavy: int
    recent: int
    score: str = DEFAULT_SCORE
    decay: Optional[float] = None
    select: str = "head"
    evict_every: int = DEFAULT_EVICT_EVERY
    obs_window: int = 0
    obs_pool: int = DEFAULT_OBS_POOL
    pin: Tuple[Tuple[int, int], ...] = field(default_factory=tuple)
    split: str = DEFAULT_SPLIT
    kv_bits: Optional[str] = None  # None (model dtype), "8", "4", or "HEAVY/RECENT" (e.g. "4/8", "4/fp")
    kv_group_size: int = DEFAULT_KV_GROUP_SIZE
    rotate: bool = False
    rotate_lam: str = DEFAULT_LAMBDA
    pool: int = 1

    @classmethod
    def build(
        cls,
        max_kv_size=None,
        split: str = DEFAULT_SPLIT,
        sink: int = DEFAULT_SINK,
        heavy: Optional[int] = None,
        recent: Optional[int] = None,
        score: str = DEFAULT_SCORE,
        decay: Optional[float] = None,
        select: str = "head",
        evict_every: int = DEFAULT_EVICT_EVERY,
        obs_window: int = 0,
        obs_pool: int = DEFAULT_OBS_POOL,
        pin=None,
        kv_bits=None,
        kv_group_size: int = DEFAULT_KV_GROUP_SIZE,
        rotate: bool = False,
        rotate_lam: str = DEFAULT_LAMBDA,
        pool: int = 1,
    ) -> "H2OConfig":
        M = check_max_kv_size(max_kv_size)
        if split not in SPLITS:
            raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
        sink = _check_int("sink", sink, 0, M - 1)
        if split == "explicit":
            if heavy is None or recent is None:
                raise ValueError("split='explicit' needs heavy and recent (sink defaults to 4), with sink + heavy + recent = max_kv_size")
            heavy = _check_int("heavy", heavy, 0)
            recent = _check_int("recent", recent, 0)
            if sink + heavy + recent != M:
                raise ValueError(f"sink + heavy + recent must equal max_kv_size={M}, got {sink} + {heavy} + {recent}")
        else:
            if heavy is not None or recent is not None:
                raise ValueError(f"heavy and recent are set by split={split!r}; give split='explicit' to choose them")
            heavy = min(int(M * SPLIT_HEAVY_FRACTION[split]), M - sink)
            recent = M - sink - heavy
        make_rule(score, decay)  # validates score and decay
        if select not in SELECTIONS:
            raise ValueError(f"select must be one of {list(SELECTIONS)}, got {select!r}")
        # Eviction keeps at least sink entries of the old context: M - evict_every >= sink.
        evict_every = _check_int("evict_every", evict_every, 1, M - sink)
        obs_window = _check_int("obs_window", obs_window, 0)
        obs_pool = _check_int("obs_pool", obs_pool, 1)
        kv_bits = _check_kv_bits(kv_bits)
        if kv_group_size not in KV_GROUP_SIZES or isinstance(kv_group_size, bool):
            raise ValueError(f"kv_group_size must be one of {KV_GROUP_SIZES}, got {kv_group_size!r}")
        if not isinstance(rotate, bool):
            raise ValueError(f"rotate must be True or False, got {rotate!r}")
        rotate_lam = "none" if rotate_lam is None else rotate_lam
        if rotate_lam not in LAMBDA_MODES:
            raise ValueError(f"rotate_lam must be one of {list(LAMBDA_MODES)}, got {rotate_lam!r}")
        pool = _check_int("pool", pool, 1)
        return cls(M, sink, heavy, recent, score, decay, select, evict_every, obs_window, obs_pool, _check_spans(pin), split,
                   kv_bits, kv_group_size, rotate, rotate_lam, pool)

    def tiers(self) -> Tuple[Optional[int], Optional[int]]:
        """(bits of the older rows, bits of the recent window); None = the model's dtype."""
        if self.kv_bits is None:
            return None, None
        heavy, _, recent = self.kv_bits.partition("/")
        as_bits = lambda t: None if t == "fp" else int(t)  # noqa: E731
        return as_bits(heavy), as_bits(recent or heavy)

    def make_store(self):
        low, high = self.tiers()
        if low == high:
            return KVStore(low, self.kv_group_size)
        return TieredKV(low, high, self.recent, self.kv_group_size)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "H2OConfig":
        d = json.loads(text)
        d["pin"] = tuple(tuple(s) for s in d["pin"])
        return cls(**d)

    def pinned_before(self, offset: int) -> int:
        """How many pinned positions lie in [0, offset)."""
        return sum(max(0, min(e, offset) - s) for s, e in self.pin)

    def pinned_mask(self, positions: mx.array) -> Optional[mx.array]:
        mask = None
        for s, e in self.pin:
            m = (positions >= s) & (positions < e)
            mask = m if mask is None else mask | m
        return mask


def select_entries(priority: mx.array, protected: mx.array, count: int, shared: bool) -> mx.array:
    """Indices (B, H, count), ascending, of the entries to keep: every protected entry, then the
    highest priorities (argpartition, not a sort). priority, protected: (B, H, P).

    shared=True picks one set per sequence for all heads from the priorities summed over heads
    (the heads then hold the same positions, so protection agrees) and returns (B, 1, count)."""
    if shared:
        priority = priority.sum(axis=1, keepdims=True)
        protected = protected.any(axis=1, keepdims=True)
    key = mx.where(protected, mx.inf, priority)
    idx = mx.argpartition(-key, kth=count - 1, axis=-1)[..., :count]
    return mx.sort(idx, axis=-1)


_EVICTION_PLANS = {}


def eviction_plan(config: H2OConfig, scoreless: bool):
    """plan(acc, positions, offset, recent_from, keep, capacity) -> (B, H, capacity) indices of the
    entries to keep (ascending), padded for a gather into buffers of `capacity` rows: the rule's
    priorities (or recency, for a cache that saw no scores) with sink, recent (positions >=
    recent_from) and pinned entries forced in. Compiled once per configuration and shape and shared
    by every layer: ~15 small ops per layer and step become one fused call (150 -> 46 µs at M = 512)."""
    key = (config, scoreless)
    if key not in _EVICTION_PLANS:
        rule = make_rule(config.score, config.decay)

        def plan(acc, positions, offset, recent_from, keep, capacity):
            # With no attention seen, keep the most recent.
            priority = positions.astype(mx.float32) if scoreless else rule.priority(acc, positions, offset)
            if config.pool > 1 and not scoreless:
                # An entry next to a heavy hitter ranks with it (the layout is in position order),
                # so spans survive whole: a copying (induction) head next reads the token after
                # the one it attends to now.
                priority = max_pool(priority, config.pool)
            protected = (positions < config.sink) | (positions >= recent_from)
            pinned = config.pinned_mask(positions)
            if pinned is not None:
                protected = protected | pinned
            idx = select_entries(priority, protected, keep, config.select == "layer")
            return pad_indices(mx.broadcast_to(idx, (*acc.shape[:2], keep)), capacity)

        _EVICTION_PLANS[key] = mx.compile(plan)
    return _EVICTION_PLANS[key]


class H2OKVCache(lm_cache._BaseCache):
    """Sink + heavy hitters + recent window, per kv head; see the module docstring."""

    def __init__(self, config: H2OConfig, seed: int = 0):
        self.config = config
        self.seed = seed  # of this layer's rotation (rotate=True)
        self.rule = make_rule(config.score, config.decay)
        self.reset()

    # ------------------------------------------------------------------ protocol
    def reset(self):
        """Forget everything (an independent generation starts from scratch)."""
        self.store = self.config.make_store()  # K/V rows (dense, packed or tiered), position order
        self.rotation: Optional[KVRotation] = None  # rotate=True: the layer's rotation and λ
        self.acc = self.positions = None
        self.offset = 0  # tokens processed: RoPE position of the next token
        self.length = 0  # entries physically held
        self.peak = 0  # most entries ever held at once (bound: M + evict_every - 1 + pinned)
        self.evictions = 0
        self.scoreless = False
        self._awaiting_scores = False

    def size(self):
        return self.length

    def empty(self):
        return self.acc is None

    @property
    def nbytes(self):
        # Stored K/V rows plus the per-entry score and position bookkeeping.
        n = self.length
        return self.store.nbytes() + sum(a[..., :n].nbytes for a in (self.acc, self.positions) if a is not None)

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

    @property
    def state(self):
        meta = json.dumps({"config": self.config.to_json(), "seed": self.seed, "offset": self.offset, "length": self.length,
                           "peak": self.peak, "evictions": self.evictions, "scoreless": self.scoreless})
        if self.acc is None:
            return None, None, None, None, meta
        n = self.length
        rotation = None if self.rotation is None else self.rotation.state
        return (self.store.state(), rotation, self.acc[..., :n], self.positions[..., :n], meta)

    @state.setter
    def state(self, v):
        store, rotation, acc, positions, meta = v
        meta = json.loads(meta)
        self.config = H2OConfig.from_json(meta["config"])
        self.seed = meta.get("seed", 0)
        self.rule = make_rule(self.config.score, self.config.decay)
        self.store = self.config.make_store()
        if store is not None:
            self.store.load(store)
        self.rotation = None if rotation is None else KVRotation.from_state(rotation)
        self.acc, self.positions = acc, positions
        self.offset, self.length, self.peak = meta["offset"], meta["length"], meta["peak"]
        self.evictions, self.scoreless = meta["evictions"], meta["scoreless"]
        self._awaiting_scores = False
        hook.install()  # a loaded cache must reach attend() like a made one

    @property
    def meta_state(self):
        return self.state[-1]

    @classmethod
    def merge(cls, caches):
        raise ValueError(
            "the h2o cache does not support mlx-lm's BatchGenerator yet; batch equal-length sequences "
            "in one model call instead (each sequence is evicted independently)"
        )

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        if window_size is not None and self.offset + N > window_size:
            raise ValueError(
                "an h2o layer cannot serve a sliding-window mask (its entries differ per layer and head); "
                "sliding-window layers keep their own cache"
            )
        if N == 1:
            return None  # a single query sees every held entry
        if return_array:
            return create_causal_mask(N, self._planned_length(N))
        return "causal"

    # ------------------------------------------------------------------ eviction plan
    def _keep_count(self, L: int) -> Optional[int]:
        """Entries of the current layout to keep before appending L tokens, or None for no eviction."""
        cfg = self.config
        P = self.length
        pinned = cfg.pinned_before(self.offset)
        if P + L <= cfg.max_kv_size + cfg.evict_every - 1 + pinned:
            return None
        target = cfg.max_kv_size - min(L, cfg.evict_every)  # unpinned entries to keep
        keep = min(P - pinned, target) + pinned
        return keep if keep < P else None

    def _planned_length(self, L: int) -> int:
        keep = self._keep_count(L)
        return self.length if keep is None else keep

    def _recent_kept(self, keep: int) -> int:
        """Entries of the recent window an eviction to `keep` protects (the new tokens complete it);
        they are the newest entries, the tail of the layout."""
        cfg = self.config
        return max(keep - cfg.pinned_before(self.offset) - cfg.sink - cfg.heavy, 0)

    def _evict(self, keep: int, capacity: int):
        n = self.length
        plan = eviction_plan(self.config, self.scoreless)
        recent = self._recent_kept(keep)
        offset, recent_from = mx.array(self.offset, mx.int32), mx.array(self.offset - recent, mx.int32)
        idx = plan(self.acc[..., :n], self.positions[..., :n], offset, recent_from, keep, capacity)
        self.store.gather(idx, keep, recent, capacity)
        self.acc, self.positions = gather_rows(self.acc, idx), gather_rows(self.positions, idx)
        self.length = keep
        self.evictions += 1

    def _capacity(self, needed: int) -> int:
        cfg = self.config
        steady = cfg.max_kv_size + cfg.evict_every - 1 + cfg.pinned_before(self.offset + 1)
        if needed > steady:
            return needed
        return min(steady, -(-needed // GROW_STEP) * GROW_STEP)

    # ------------------------------------------------------------------ mlx-lm calls
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if self._awaiting_scores:
            self._lost_scores()
        B, H, L, _ = keys.shape
        if self.acc is not None and (B, H) != tuple(self.acc.shape[:2]):
            raise ValueError(f"keys have batch/heads {(B, H)} but the cache holds {tuple(self.acc.shape[:2])}; reset() it first")
        keep = self._keep_count(L) if self.acc is not None else None
        if keep is not None:
            self._evict(keep, self._capacity(keep + L))
        if self.config.rotate:
            if self.rotation is None:
                self.rotation = KVRotation.seeded(keys.shape[-1], values.shape[-1], seed=self.seed)
                if self.config.rotate_lam == "prefill":
                    self.rotation.fit_lambdas(keys, values)
            keys, values = self.rotation.keys(keys), self.rotation.values(values)
        P = self.length
        if self.acc is None or P + L > self.acc.shape[2]:
            self._grow(B, H, self._capacity(P + L))
        self.store.append(keys, values, self.acc.shape[2])
        self.acc[..., P : P + L] = mx.zeros((B, H, L), mx.float32)
        self.positions[..., P : P + L] = mx.broadcast_to(mx.arange(self.offset, self.offset + L, dtype=mx.int32), (B, H, L))
        self.offset += L
        self.length = P + L
        self.peak = max(self.peak, self.length)
        self._awaiting_scores = True
        if isinstance(self.store, KVStore) and self.store.k.bits is None and self.rotation is None:
            return self.store.k.view(self.length), self.store.v.view(self.length)  # plain arrays, as KVCache
        # Packed, tiered or rotated rows: the segments go through the model untouched to attend().
        return self.store.segments(), None

    def _grow(self, B, H, capacity):
        def grown(buf, shape, dtype):
            fresh = mx.zeros(shape, dtype)
            if buf is None:
                return fresh
            return mx.concatenate([buf[:, :, : self.length], fresh[:, :, : capacity - self.length]], axis=2)

        self.acc = grown(self.acc, (B, H, capacity), mx.float32)
        self.positions = grown(self.positions, (B, H, capacity), mx.int32)

    def attend(self, queries, keys, values, *, scale, mask=None, sinks=None):
        """Attention for this layer (called through the hook), folding the scores into the cache."""
        segments = keys if isinstance(keys, list) else [(keys, values)]
        N = sum((k.packed if hasattr(k, "packed") else k).shape[2] for k, _ in segments)
        if N != self.length:
            raise ValueError(f"attention over {N} keys but the h2o cache holds {self.length}: keys must come from update_and_fetch")
        L = queries.shape[2]
        dtype = queries.dtype
        if self.rotation is not None:
            queries = self.rotation.queries(queries)  # <R q, R k> = <q, k>: attend in the stored space

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
        self.acc[..., :N] = self.rule.update(self.acc[..., :N], stats, L, live)
        self._awaiting_scores = False
        return out if self.rotation is None else self.rotation.output(out, dtype)

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


def _last_rows(mask, w: int, L: int):
    if mask is None or isinstance(mask, str):
        return mask  # "causal" puts row i at N - rows + i: right for the last w rows too
    if mask.ndim >= 2 and mask.shape[-2] == L:
        return mask[..., -w:, :]
    return mask


register_cache_class(H2OKVCache)


@register_policy("h2o")
def h2o_cache(model, max_kv_size=None, **options):
    """Heavy-hitter caches for `model`: H2OKVCache on every plain KVCache layer (sliding-window and
    other special layers keep the model's own cache). Installs the attention hook."""
    allowed = sorted(set(H2OConfig.build.__code__.co_varnames[2 : H2OConfig.build.__code__.co_argcount]))
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"unknown h2o options {unknown}; allowed: {allowed}")
    config = H2OConfig.build(max_kv_size, **options)
    hook.install()
    layer = itertools.count()
    return per_layer_caches(model, lambda: H2OKVCache(config, seed=next(layer)))


__all__ = ["H2OConfig", "H2OKVCache", "SCORE_RULES", "select_entries", "h2o_cache"]
