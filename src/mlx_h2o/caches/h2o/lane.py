"""`Lane`: the entries that share one layout in an h2o layer.

With a uniform head budget every kv head of the layer holds the same number of entries, so the
whole layer is one lane: (B, H, n) rows, one fused attention call, one vectorised eviction. With
per-head budgets (`head_budget="adaptive"`) heads hold different numbers of entries, and each
(batch row, kv head) is a lane of its own: nothing is padded, and attention runs once per lane with
that head's query group (the price: B x H kernel calls per layer). Every part of the cache (scorer,
keeper, storage) works on a lane, so per-head budgets combine with all of them.

A lane holds its rows with their per-entry columns (score accumulator, position, and multiplicity
when the keeper merges), the archive of evicted entries when the keeper keeps one, and the running
query statistics of its heads (expected attention).
"""

from typing import Optional

import mlx.core as mx
import numpy as np

from ..._ops import MAX_SEGMENTS
from ...attention import attention_with_scores
from ...storage import ColumnedKV, KVStorage, KVStore

# Per query row, the weight the running query statistics keep (about the last 20 rows): recent
# queries, whose RoPE phases are close to the next ones'.
QUERY_DECAY = 0.95


class Lane:
    """Rows `batch` x kv heads `heads` of a layer (slices), their storage and archive."""

    def __init__(self, store: ColumnedKV, archive: Optional[ColumnedKV], batch: slice = slice(None), heads: Optional[slice] = None):
        self.store, self.archive = store, archive
        self.batch, self.heads = batch, heads  # heads None: every kv head (and batch row) of the layer
        self.q_mean = self.q_sq = None  # (B, Hq, D) running mean and mean square of the stored-space queries
        self.archive_size, self.row_dtype = 0, None  # the archive's entries at most; the dtype (name) rows enter it in

    @property
    def length(self) -> int:
        return self.store.length

    @property
    def archived(self) -> int:
        return 0 if self.archive is None else self.archive.length

    def query_heads(self, Hq: int, kv_heads: int) -> slice:
        """This lane's query heads among the layer's Hq (each kv head serves Hq / kv_heads of them)."""
        if self.heads is None:
            return slice(None)
        G = Hq // kv_heads
        return slice(self.heads.start * G, self.heads.stop * G)

    def queries_of(self, x: mx.array, kv_heads: int) -> mx.array:
        """This lane's rows and query heads of a (B, Hq, ...) array of the layer's."""
        return x if self.heads is None else x[self.batch, self.query_heads(x.shape[1], kv_heads)]

    def rows_of(self, x: mx.array) -> mx.array:
        """This lane's rows and kv heads of a (B, H, ...) array of the layer's."""
        return x if self.heads is None else x[self.batch, self.heads]

    def segments(self, own=None) -> list:
        """What attention reads: the archive's rows (older than every query), then the lane's, or
        `own` in their place: the segments update_and_fetch returned ((list, None), as they are), or
        (keys, values), what the model made of the fetched rows (MLA expands its latent rows into
        keys and values before attending)."""

        def collect(own):
            archived = self.archive.segments() if self.archive is not None else []
            if own is None:
                return archived + self.store.segments()
            if isinstance(own[0], list):
                return archived + own[0]
            return archived + (self.store.attended(own) or [own])  # the store's buffers in place of its slices

        segments = collect(own)
        if len(segments) > MAX_SEGMENTS:  # rows shared with copies come in pieces (storage/kv.py): join them
            for store in self.stores():
                store.own_rows()
            segments = collect(None if own is None or isinstance(own[0], list) else own)
        return segments

    def stores(self) -> list:
        """The lane's row stores in row order: its archive (if it has one), then its own."""
        return ([self.archive] if self.archive is not None else []) + [self.store]

    def nbytes(self) -> int:
        return sum(store.nbytes() for store in self.stores())

    def attend(self, queries: mx.array, scorer, *, scale, mask, sinks, kv_heads: int, own=None):
        """This lane's attention over its archive and rows for its share of the layer's queries
        (B, Hq, L, D) and sinks (the layer has `kv_heads`), folding the scores into the score column:
        (output in the model's space and dtype, the op's raw scores)."""
        store, T = self.store, self.archived
        # rotated storage: <R q, R k> = <q, k>; the op rotates the queries and output itself, unless
        # expected attention needs the rotated queries
        rotations = store.rotations() if scorer.expected == 0 else None
        q = self.queries_of(queries, kv_heads)
        if rotations is None:
            q = store.prepare_queries(q)
        if scorer.expected > 0:
            self.track_queries(q)
        if sinks is not None:
            sinks = sinks[self.query_heads(sinks.shape[0], kv_heads)]
            center = store.key_center(stored=rotations is None)  # in the space of the q the op takes
            if center is not None:  # keys stored less c: their logits are q . c lower, the sinks' are not
                mask = _with_shift(mask, _logit_shift(q, center, scale), T + store.length)
        if "mult" in store.dtypes:
            mask = _with_bias(mask, mx.log(store.column("mult")), q.shape[1], q.shape[2])  # merged: + log multiplicity
        dead = store.dead_rows()
        if dead is not None:  # rows of a shared prefix this lane no longer keeps (storage/columns.py)
            mask = _with_bias(mask, mx.where(dead, -mx.inf, 0.0), q.shape[1], q.shape[2])
        segments = self.segments(own)

        q_rotation, out_rotation = rotations or (None, None)
        heads = kv_heads if self.heads is None else 1
        own_heads = own is None or not isinstance(own[0], mx.array) or own[0].shape[1] == heads  # (MLA attends other heads)
        if not T and q.shape[2] == 1 and scorer.rule.folds_mass and own_heads:
            out, raw = self._attend_folding(q, segments, scorer.rule, scale=scale, mask=mask, sinks=sinks, rotations=rotations)
        else:
            def op(q, mask, scores):
                return attention_with_scores(q, segments, scale=scale, mask=mask, scores=scores, sinks=sinks,
                                             q_rotation=q_rotation, out_rotation=out_rotation)

            out, raw, stats, rows, live = scorer.observe(op, q, mask, heads, T + store.live_length)
            alpha, beta = scorer.rule.coefficients(rows, live)
            if T:
                self.archive.accumulate("acc", stats[..., :T], alpha, beta)
            out = store.accumulate("acc", stats[..., T:] if T else stats, alpha, beta, along=out)
        out = out if rotations else store.restore_output(out, queries.dtype)
        others = self.updates()
        return (mx.depends(out, others) if others else out), raw

    def reads_rows_alone(self, scorer) -> bool:
        """Whether a decode row's attention needs nothing but the lane's own rows and the op's mass
        (`attend_row`): the lane is all of the layer, with no archive, merged entries or running
        query statistics, and the score rule folds the op's mass."""
        return self.heads is None and self.archive is None and "mult" not in self.store.dtypes and scorer.expected == 0 and scorer.rule.folds_mass

    def attend_row(self, queries: mx.array, rule, own, *, scale):
        """`attend` for one decode row of the layer's queries (B, Hq, 1, D), without a mask or sinks,
        over `own`, the (keys, values) the store's `append_in_place` returned, where the lane is all
        of the layer and keeps no archive, merges or running query statistics, and the rule folds
        mass (the caller's part: `reads_rows_alone`): the op reads the rows in place and folds its
        mass into the score column, nothing else is built. Returns the output (the model's space and
        dtype), or None (nothing done) where the store does not read `own` in place or holds dead rows."""
        store = self.store
        segments = store.attended(own) if store.dead is None else None
        if segments is None:
            return None
        rotations = store.rotations()
        q = queries if rotations else store.prepare_queries(queries)
        out, _ = self._attend_folding(q, segments, rule, scale=scale, mask=None, sinks=None, rotations=rotations)
        return out if rotations else store.restore_output(out, queries.dtype)

    def _attend_folding(self, q, segments, rule, *, scale, mask, sinks, rotations):
        """A decode row over the lane's own rows: its stats are the op's mass, which the op folds
        into the score column itself (an output of the attention primitive: no primitive of its
        own). Returns (output in the stored space, raw scores)."""
        store = self.store
        alpha, beta = rule.coefficients(1, store.live_length)
        column, held = store.folding("acc", store.length)
        q_rotation, out_rotation = rotations or (None, None)
        out, raw, column = attention_with_scores(q, segments, scale=scale, mask=mask, scores="mass", sinks=sinks, q_rotation=q_rotation,
                                                 out_rotation=out_rotation, score_column=(column, alpha, beta, held))
        store.folded("acc", column)
        return out, raw

    def updates(self) -> list:
        """What attention updates beside its output and its score column (the archive's columns, the
        running query statistics). Each call's update reads the last one's, so left unevaluated they
        would chain every step's scores until the next eviction read them (~0.4 MB a token for
        SmolLM2, growing without bound under an M not reached). So the output carries them: the
        score column's update is an output of the primitive that passes the attention output on
        (ColumnedKV.accumulate), the others are its dependencies. A separate evaluation of them every
        few tokens (an `async_eval` per layer, 60-300 µs each) cost more than their few primitives."""
        # (The lane's other columns change only at an append or an eviction, not from step to step;
        # the archive's all change at an eviction, which writes them at once: keeper.py.)
        archived = list(self.archive.columns.values()) if self.archive is not None and self.archive.columns else []
        return archived + ([self.q_mean, self.q_sq] if self.q_mean is not None else [])

    def trimmable(self, n: int, offset: int) -> int:
        """How many of the newest n tokens this lane can forget: its trailing run of consecutive
        positions ending at offset - 1."""
        n = min(n, self.length)
        tail = np.array(self.store.column("pos")[..., self.length - n :])
        run = (tail == np.arange(offset - n, offset)).all(axis=(0, 1))[::-1]
        return int(n if run.all() else np.argmin(run))

    def track_queries(self, queries: mx.array) -> None:
        """Fold a call's query rows (stored space) into the running mean and mean square (EMA,
        QUERY_DECAY per row)."""
        L = queries.shape[2]
        q = queries.astype(mx.float32)
        mean, square = q.mean(axis=2), (q * q).mean(axis=2)
        if self.q_mean is None or self.q_mean.shape != mean.shape:
            self.q_mean, self.q_sq = mean, square
        else:
            d = QUERY_DECAY**L
            self.q_mean = d * self.q_mean + (1.0 - d) * mean
            self.q_sq = d * self.q_sq + (1.0 - d) * square

    def content(self, scale: Optional[float]):
        """What content-aware priorities read (Scorer.priority): the held keys, dense, the running
        query mean and variance, and the attention scale."""
        keys, _ = self.store.read_rows()
        if self.q_mean is None:  # no query seen (cannot happen once scores arrived): expected attention is flat
            B, H, _, D = keys.shape
            self.q_mean = self.q_sq = mx.zeros((B, H, D), mx.float32)
        var = mx.maximum(self.q_sq - self.q_mean * self.q_mean, 0.0)
        return keys, self.q_mean, var, mx.array(scale or 1.0, mx.float32)

    def state(self):
        queries = None if self.q_mean is None else {"mean": self.q_mean, "square": self.q_sq}
        archive = None if self.archive is None else self.archive.state()
        return {"rows": self.store.state(), "archive": archive, "queries": queries}

    def load(self, state) -> None:
        self.store.load(state["rows"])
        if self.archive is not None:
            self.archive.load(state["archive"])
        if state.get("queries") is not None:
            self.q_mean, self.q_sq = state["queries"]["mean"], state["queries"]["square"]


def make_lanes(config, seed: int, B: int, H: int, budget=None):
    """A layer's lanes: one for all its heads, or one per (batch row, kv head) under per-head budgets.
    `budget`: the layer's in force (less an archive's share; default the policy's)."""
    adaptive = config.budget.head_budget == "adaptive"
    where = [(slice(None), None)] if not adaptive else [(slice(b, b + 1), slice(h, h + 1)) for b in range(B) for h in range(H)]
    fmt, merges = config.keeper.archive_format, config.keeper.merge is not None
    # Dead rows (a shared prefix kept in place) are skipped by attention and the layer-wide plan; the
    # keepers that rewrite or move rows and the per-head selection would read them as entries.
    masks_shared = fmt is None and not merges and not adaptive
    window, budget = config.storage.high_rows(config.budget.recent), budget or config.budget
    # Two tiers: the high one holds the window plus up to one eviction step, as the byte bound counts
    # them (bytes.py), where the low tier then never holds more than M - window rows: the budget in
    # force protects the storage's window (an archive's share can cut its recent part below it), and
    # its M is fixed (a dispersion budget changes it after the lanes are made).
    fixed = budget.layer_budget != "dispersion" and budget.recent >= window
    slack = max(0, min(window + budget.evict_every, budget.max_kv_size) - window) if fixed else 0
    return [Lane(entry_store(config.storage.make(window, seed, slack, config.storage.sink_rows(budget.sink)), merges, masks_shared),
                 None if fmt is None else archive_store(fmt, config.storage.group_size), *w) for w in where]


def join_outputs(outs, shape):
    """The layer's attention output (B, Hq, L, D) from its lanes' (b-major, as make_lanes orders them)."""
    if len(outs) == 1:
        return outs[0]
    B, H = shape
    return mx.concatenate([mx.concatenate(outs[b * H : (b + 1) * H], axis=1) for b in range(B)])


def archive_store(bits, group_size: int) -> ColumnedKV:
    """The archive of evicted entries: rows at `bits` with their score and position."""
    return ColumnedKV(KVStore(bits, group_size), {"acc": "float32", "pos": "int32"})


def entry_store(rows: KVStorage, merges: bool, masks_shared: bool = False) -> ColumnedKV:
    """A lane's rows with their score accumulator, position, and multiplicity when entries merge."""
    return ColumnedKV(rows, {"acc": "float32", "pos": "int32", **({"mult": "float32"} if merges else {})}, masks_shared)


def _logit_shift(queries: mx.array, center: mx.array, scale: float) -> mx.array:
    """scale x q . c per query row (B, Hq, L, 1), c (B, H, 1, D) repeated over each kv head's queries."""
    c = mx.repeat(center, queries.shape[1] // center.shape[1], axis=1)
    return scale * (queries.astype(mx.float32) * c).sum(axis=-1, keepdims=True)


def _with_shift(mask, shift: mx.array, N: int) -> mx.array:
    """The attention mask plus `shift` (B, Hq, L, 1) on every one of the N entries' logits."""
    B, Hq, L, _ = shift.shape
    return _plus_mask(mask, mx.broadcast_to(shift, (B, Hq, L, N)), N, L)


def _with_bias(mask, bias: mx.array, Hq: int, L: int) -> mx.array:
    """The attention mask plus `bias` (B, H, N) on each entry's logit, for every query head of its
    kv head: an additive (B, Hq, L or 1, N) array."""
    B, H, N = bias.shape
    return _plus_mask(mask, mx.repeat(bias, Hq // H, axis=1)[:, :, None, :], N, L)  # bias (B, Hq, 1, N)


def _plus_mask(mask, bias: mx.array, N: int, L: int) -> mx.array:
    """An additive mask: `mask` (None, "causal", boolean or additive) plus `bias` on the logits it allows."""
    if mask is None:
        return bias
    if isinstance(mask, mx.array) and mask.shape[-1] != N:
        # The cache plans its mask arrays causal (make_mask) for the rows an eviction keeps; one that
        # kept a shared prefix in place (dead rows) holds more rows than it could plan.
        mask = "causal"
    if isinstance(mask, str):  # "causal": row i sits at N - L + i
        mask = mx.arange(N)[None, :] <= mx.arange(N - L, N)[:, None]
    if mask.dtype == mx.bool_:
        return mx.where(mask, bias, -mx.inf)
    return mask + bias
