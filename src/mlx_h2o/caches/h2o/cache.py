"""`H2OKVCache`: the heavy-hitter cache of one layer, composed of its configuration's parts.

Per kv head the cache keeps M = sink + heavy + recent entries (the budget, budget.py) plus any pinned
spans. The fused kernel's score export tells the scorer (scorer.py) how much attention each entry
received; when the budget is exceeded the highest priorities and the protected entries are kept
(eviction.py), and the keeper (keeper.py) drops, merges or archives the rest. Rows and their
per-entry columns live in storage (storage.py, mlx_h2o.storage), in lanes (lane.py): one for the
layer, or one per kv head under per-head budgets.

How it fits mlx-lm without model edits:
- Models reach attention through `mlx_lm.models.base.scaled_dot_product_attention`, which hands the
  call to `attend` (caches/base.py), where the op runs with scores and the rule accumulates them.
- `offset` counts the tokens processed (RoPE positions, masks); `length` is what is stored (the mean
  over heads). They differ once anything is evicted, and the model never sees `length` as a
  position (resetting `offset` after eviction was the MLX seed's garbage-output bug).
- Eviction happens at the start of `update_and_fetch`, before the new tokens are appended, from the
  scores gathered so far; `make_mask` plans the same eviction, so the mask built before the layer
  runs matches the evicted layout. Rows stay in position order and new tokens are appended at the
  end, so the ordinary causal mask is right for the evicted layout.
- A byte budget (`max_kv_bytes`, bytes.py) resolves M and the storage when the first keys show the
  model's shape, and then never holds more than M entries: a call of more than `evict_every` tokens
  (a prefill chunk) is stashed by `update_and_fetch` and appended and attended by `attend` in steps
  of `evict_every`, each evicting first as decode does, so its queries see at most M entries.
- Models whose attention bypasses mlx-lm's function (mlx-lm's gemma2 computes soft-capped attention
  inline) give no scores: the cache notices, warns once and keeps sink + the most recent entries.
"""

import warnings
from typing import Optional

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

from ...attention import PackedKV
from ...distributed import SharesGroup
from ...storage import dtype_name, stored_as
from ..base import AttendingCache, fetched_ids, handed_on
from ..batch import SequenceBatch
from .bytes import resolve
from .eviction import choose_entries
from .lane import join_outputs, make_lanes
from .options import H2OConfig
from .spread import attention_entropy

NO_SCORES = ("h2o: this model computes attention without mlx_lm.models.base.scaled_dot_product_attention (or the hook "
             "was removed), so the cache gets no attention scores; it keeps sink + recent entries instead (a sliding window)")


class H2OKVCache(SharesGroup, AttendingCache):
    """Sink + heavy hitters + recent window, per kv head; see the module docstring."""

    save_format = 3
    _COUNTERS = ("offset", "length", "peak", "evictions", "scoreless", "scale", "budget_allocated", "shape", "head_dims", "row_dtype")

    def __init__(self, config: H2OConfig, seed: int = 0, group: Optional[mx.distributed.Group] = None,
                 layers: Optional[int] = None):
        self.config, self.seed = config, seed  # the policy's; this layer's rotation's seed
        # a byte budget: the model's h2o layers sharing max_kv_bytes (config resolved at the first keys)
        self.layers = layers
        # tensor parallel: the ranks holding this layer's other heads; choices shared by heads all-reduce over them
        self.group = group
        self.layer_budget = config.budget  # this layer's (M may differ from the policy's: layer_budget, spread.py)
        # dispersion: the model's caches share a group that fixes every layer's M when the first fills (spread.py)
        self.budget_group, self.budget_index = None, 0
        self.budget_allocated = config.budget.layer_budget != "dispersion"
        self.evict_phase = None  # this layer's turn to compact (Budget.keep_count); the policy staggers its layers
        self._kept_for = self._kept = None  # kept_dtype's answer by name (None: as the rows come) and the config it is for
        self.reset()

    def reset(self):
        """Forget everything (an independent generation starts from scratch)."""
        self.lanes = None  # set by the first rows, with (B, H), the head dims and the rows' dtype
        self._row_lane = None  # the one lane, where a decode row attends its rows alone (_start)
        self.shape = self.head_dims = self.row_dtype = None  # row_dtype by name ("float16"): caches deep-copy
        self.offset = self.length = self.peak = self.evictions = 0
        self.scoreless, self._awaiting_scores, self.scale = False, False, None
        self._pending = None  # a byte budget's multi-token call, appended in steps by attend
        # Whether the model hands the fetched rows to attention untouched (mlx-lm's attention): then
        # they may come in shared pieces (storage/kv.py). Models that read them (gemma2's inline
        # attention, MLA's latent rows) get arrays (caches/base.py: handed_on).
        self.passes_rows, self._fetched_id = False, None
        self.budget, self.archive_size = self.layer_budget, 0  # in force: less the archive's share once the first rows came

    def set_layer_budget(self, m: int):
        """This layer's M (layer_budget: pyramid, or dispersion once allocated)."""
        self.layer_budget, self.budget_allocated = self.config.budget.for_layer(m), True
        self.budget = self.layer_budget
        if self.lanes is not None:
            self._start(*self.shape, self.head_dims, self.row_dtype, self.lanes)

    # ------------------------------------------------------------------ mlx-lm's protocol
    def size(self):
        return self.length

    def empty(self):
        return self.lanes is None

    @property
    def nbytes(self):
        return sum(lane.nbytes() for lane in self.lanes or ())

    def is_trimmable(self):
        return True

    def trim(self, n):
        """Drop the last n tokens (speculative decoding): as many as every lane holds as its newest run."""
        n = min([n, self.length] + [lane.trimmable(n, self.offset) for lane in self.lanes or ()])
        if n <= 0 or self.lanes is None:
            return 0
        for lane in self.lanes:
            lane.store.trim(n)
        self.length, self.offset = self.length - n, self.offset - n
        return n

    def __deepcopy__(self, memo):
        """A copy shares the rows held (storage/kv.py): mlx-lm's server forks a prompt-cache snapshot
        for each request. A prefill leaves more than M entries, which each copy's first call would
        evict, and rows dropped from a shared prefix cost reading them (storage/columns.py), so the
        cache is compacted first, as its next call would compact it: the copies then share only the
        entries they keep. (Not while a byte budget's call is pending, a dispersion budget is not
        allocated, or ranks would have to agree: their copies need not be in step.)"""
        pinned = self.budget.pinned_before(self.offset)
        if (self.lanes is not None and self._pending is None and self.budget_allocated and self.group is None
                and self.length > self.budget.max_kv_size + pinned):
            self._evict(self.budget.keep_count(self.length, self.offset, 1), 0)
        return super().__deepcopy__(memo)

    @classmethod
    def merge(cls, caches):
        """mlx-lm's BatchGenerator: several sequences' caches of this layer as one batch cache
        (caches/batch.py), each evicting on its own."""
        batch = SequenceBatch.merge(caches)
        if any(c.shape is not None and c.shape[0] != 1 for c in batch.caches):
            raise ValueError("h2o caches merge into a batch only from single-sequence caches")
        return batch

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        if window_size is not None and self.offset + N > window_size:
            raise ValueError("an h2o layer cannot serve a sliding-window mask: sliding-window layers keep their own cache")
        if N == 1:
            return None  # a single query sees every held entry
        self._allocate_budgets(N)
        if not return_array:
            return "causal"
        keep = None if self.lanes is None else self.budget.keep_count(self.length, self.offset, N, self.evict_phase)
        lanes = self.lanes or []
        if len({(lane.length, lane.archived) for lane in lanes}) > 1 or (keep is not None and len(lanes) > 1):
            raise ValueError("head_budget='adaptive' keeps different entries per head: no single mask array; use 'causal'")
        held = lanes[0].length if lanes else 0  # rows, dead ones included (a shared prefix kept in place)
        mask = create_causal_mask(N, held if keep is None else keep)
        T = lanes[0].archived if lanes else 0  # the archive's rows come first, older than every query
        return mx.concatenate([mx.ones((*mask.shape[:-1], T), mask.dtype), mask], axis=-1) if T else mask

    # ------------------------------------------------------------------ the layer's calls
    def kept_dtype(self, dtype):
        """The dtype rows that arrive in `dtype` are kept in before any packing (the flat llama block
        has its kernel write them so). Until the budget is resolved they must come in the model's
        dtype, which a byte budget is sized in."""
        config = self.config
        if self._kept_for is not config:  # (asked by every layer at every step: worked out once per configuration)
            kv_dtype = config.storage.kv_dtype
            self._kept_for, self._kept = config, None if kv_dtype is None or not config.budget.resolved else kv_dtype
        return dtype if self._kept is None else getattr(mx, self._kept)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if self._awaiting_scores and not self.scoreless:
            warnings.warn(NO_SCORES, RuntimeWarning, stacklevel=2)
        self.scoreless |= self._awaiting_scores
        if self.lanes is None and not self.config.budget.resolved:
            # in the model's dtype: the budget is in its tokens, and the rule may choose kv_dtype
            self._resolve(keys.shape[1], (keys.shape[-1], values.shape[-1]), keys.dtype.size)
        keys, values = stored_as(self.config.storage.kv_dtype, keys, values)
        B, H, L, _ = keys.shape
        if self.lanes is None:
            self.config.storage.check_rows(keys, values, packed=self.config.keeper.evicted_bits is not None)
            self._start(B, H, (keys.shape[-1], values.shape[-1]), dtype_name(keys.dtype))
        elif (B, H) != self.shape:
            raise ValueError(f"keys have batch/heads {(B, H)} but the cache holds {self.shape}; reset() it first")
        if self.config.budget.max_kv_bytes is not None and L > self.budget.evict_every:
            self._pending = (keys, values)  # attend appends them in steps (_attend_in_steps)
            return [], None
        return self._append(keys, values)

    def _append(self, keys: mx.array, values: mx.array):
        """Evict if the call would take the cache past M, append the rows, return what attention reads."""
        L = keys.shape[2]
        self._allocate_budgets(L)
        keep = self.budget.keep_count(self.length, self.offset, L, self.evict_phase)
        if keep is not None:
            self._evict(keep, L)
        # written when read (ColumnedKV): a score of 0, the positions, a multiplicity of 1
        new = {"acc": 0.0, "pos": range(self.offset, self.offset + L)}
        if self.config.keeper.merge is not None:
            new["mult"] = 1.0
        # one lane whose dense rows have room (a decode step, mostly): written in place, nothing else
        fetched = self.lanes[0].store.append_in_place(keys, values, **new) if len(self.lanes) == 1 else None
        if fetched is None:
            for lane in self.lanes:
                capacity = self.budget.buffer_capacity(self.offset, lane.length + L)
                lane.store.append(lane.rows_of(keys), lane.rows_of(values), capacity, **new)
        self.offset, self.length = self.offset + L, self.length + L
        self.peak, self._awaiting_scores = max(self.peak, self.length), True
        if len(self.lanes) > 1:
            return self.lanes, None
        if fetched is None:
            store = self.lanes[0].store
            if not self.passes_rows:
                store.own_rows()
            fetched = store.fetch()
        self._fetched_id = fetched_ids(fetched)
        return fetched

    def _resolve(self, H: int, head_dims, itemsize: int):
        """A byte budget's configuration and M for this model's shape (bytes.py): per sequence and layer,
        max_kv_bytes over the h2o layers. Tensor parallel, the budget is the whole model's: each of the
        N ranks holds H of the N x H heads and takes 1/N of the bytes, so every rank resolves the M one
        rank would, with no communication (the group agrees by construction)."""
        total, ranks = self.config.budget.max_kv_bytes, 1 if self.group is None else self.group.size()
        layers = self.layers or 1
        self.config = resolve(self.config, total // layers // ranks, H, head_dims, itemsize, total=total, layers=layers * ranks)
        self.layer_budget = self.budget = self.config.budget

    def _start(self, B: int, H: int, head_dims, dtype, lanes=None):
        """The first rows fix the layout (one lane, or one per (batch row, kv head) under per-head
        budgets) and the archive's share of the budget (keeper.py)."""
        self.shape, self.head_dims, self.row_dtype = (B, H), tuple(head_dims), dtype
        self.budget, self.archive_size = self.config.keeper.split(self.layer_budget, self.config.storage, self.head_dims, getattr(mx, dtype).size)
        self.lanes = lanes or make_lanes(self.config, self.seed, B, H, self.budget)
        for lane in self.lanes:
            lane.archive_size, lane.row_dtype = self.archive_size, dtype
        # (asked at every decode step: worked out once per layout)
        self._row_lane = self.lanes[0] if len(self.lanes) == 1 and self.lanes[0].reads_rows_alone(self.config.scorer) else None

    def _evict(self, keep: int, L: int):
        """Keep `keep` entries per head (the budget's protected, the scorer's best); the keeper takes the rest."""
        capacity, recent = self.budget.buffer_capacity(self.offset, keep + L), self.budget.recent_kept(self.offset, keep)
        chosen = choose_entries(self.lanes, self.shape, self.budget, self.config.scorer, self.offset, keep, capacity, recent,
                                self.scoreless, self.scale, self.group)
        for lane, idx, kept in chosen:
            self.config.keeper.evict(lane, idx, kept, recent, capacity - keep + kept, self.config.scorer.rule, self.offset, self.scoreless)
        self.length, self.evictions = keep, self.evictions + 1

    def _allocate_budgets(self, L: int):
        if self.budget_group is not None and self.lanes is not None:
            self.budget_group.allocate_before_eviction(self.budget.keep_count(self.length, self.offset, L, self.evict_phase))

    def attend(self, queries, keys, values, *, scale, mask=None, sinks=None):
        """Attention for this layer, each lane's scores folded into its columns."""
        if self._pending is not None:
            return self._attend_in_steps(queries, scale=scale, sinks=sinks)
        handed = handed_on(self._fetched_id, keys, values)
        self.passes_rows |= handed
        lane = self._row_lane
        if (handed and lane is not None and mask is None and sinks is None and queries.shape[2] == 1
                and (self.budget_group is None or self.budget_group.allocated)):
            # a decode step (the general path below, without what this layer does not need)
            out = lane.attend_row(queries, self.config.scorer.rule, (keys, values), scale=scale)
            if out is not None:
                self.scale, self._awaiting_scores = float(scale), False
                return out
        _check_call(self.lanes, keys, values, mask, handed)
        self.scale, outs = float(scale), []
        for lane in self.lanes:
            out, raw = lane.attend(queries, self.config.scorer, scale=scale, mask=mask, sinks=sinks, kv_heads=self.shape[1],
                                   own=(keys, values) if len(self.lanes) == 1 else None)  # what the model attends (MLA: not the rows)
            if self.budget_group is not None and not self.budget_group.allocated:
                self.budget_group.observe(self.budget_index, attention_entropy(raw).item())
            outs.append(out)
        self._awaiting_scores = False
        return join_outputs(outs, self.shape)

    def _attend_in_steps(self, queries, *, scale, sinks):
        """A byte budget's multi-token call: its rows appended `evict_every` at a time, each step's
        queries attending what is held then (causal within the step), so the cache never passes M.
        The mask the model built is causal by construction (make_mask), so each step makes its own."""
        keys, values = self._pending
        self._pending, step, outs = None, self.budget.evict_every, []
        for s in range(0, keys.shape[2], step):
            k, v = self._append(keys[:, :, s : s + step], values[:, :, s : s + step])
            n = min(step, keys.shape[2] - s)
            outs.append(self.attend(queries[:, :, s : s + n], k, v, scale=scale, mask="causal" if n > 1 else None, sinks=sinks))
        return mx.concatenate(outs, axis=2)

    def _payload(self):  # save and load: caches/base.py's SavedCache
        return None if self.lanes is None else {"lanes": [lane.state() for lane in self.lanes]}

    def _meta(self):
        return {"config": self.config.to_json(), "seed": self.seed, "layer_max_kv_size": self.layer_budget.max_kv_size, "layers": self.layers,
                "tensor_parallel": self.group is not None, "evict_phase": self.evict_phase, **{k: getattr(self, k) for k in self._COUNTERS}}

    def _restore(self, payload, meta):
        # the process's ranks were checked against the file's (SavedCache): a tensor-parallel cache is the world's
        self.__init__(H2OConfig.from_json(meta["config"]), meta["seed"], mx.distributed.init() if meta.get("tensor_parallel") else None,
                      meta.get("layers"))
        if meta["layer_max_kv_size"] is not None:  # (None: a byte budget saved before its first keys)
            self.set_layer_budget(meta["layer_max_kv_size"])  # (budget_allocated as saved, below)
        if payload is not None:
            self._start(*meta["shape"], meta["head_dims"], meta["row_dtype"])
            for lane, state in zip(self.lanes, payload["lanes"]):
                lane.load(state)
        for k in self._COUNTERS:
            setattr(self, k, meta[k])
        self.evict_phase = meta.get("evict_phase")  # (absent: saved before compactions were staggered)
        self.shape = None if self.shape is None else tuple(self.shape)


def _check_call(lanes, keys, values, mask, handed: bool):
    """An attention call must bring what update_and_fetch returned (every entry held; `handed`: it
    did, untouched) and, for heads of different lengths, a mask that fits them all (None or 'causal')."""
    if len(lanes) > 1:
        if isinstance(mask, mx.array) and len({lane.length for lane in lanes}) > 1:
            raise ValueError("head_budget='adaptive' attends each head over its own entries: the mask must be None or 'causal'")
        return
    if handed:
        return
    if isinstance(keys, list):
        N = sum(k.length if isinstance(k, PackedKV) else k.shape[2] for k, _ in keys)
    else:
        N = keys.length if isinstance(keys, PackedKV) else keys.shape[2]
    if N != lanes[0].length:
        raise ValueError(f"attention over {N} keys but the h2o cache holds {lanes[0].length}: keys must come from update_and_fetch")
