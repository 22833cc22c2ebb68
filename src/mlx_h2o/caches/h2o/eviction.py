"""Which entries an eviction keeps: the scorer's priorities, the budget's protected entries, and the
highest priorities for the rest, per kv head or per layer (`select`)."""

import mlx.core as mx

from ..._native import _ext
from ...distributed import all_sum
from .spread import adaptive_lane_selection


def select_entries(priority: mx.array, protected: mx.array, count: int, shared: bool, dead=None, capacity: int = -1) -> mx.array:
    """Indices (B, H, count), ascending, of the entries to keep: every protected entry, then the
    highest priorities (ties: the older entry), int32, padded with zeros to `capacity` (-1: none)
    for a gather into buffers of that many rows: one primitive (`_ext.top_rows`). priority,
    protected: (B, H, P); `dead` (B, H, P) bool: rows that are no entry (ColumnedKV.dead_rows),
    never chosen.

    shared=True picks one set per sequence for all heads from the priorities summed over heads
    (the heads then hold the same positions, so protection agrees) and returns (B, 1, count)."""
    if dead is not None:
        priority, protected = mx.where(dead, -mx.inf, priority), protected & ~dead
    if shared:
        priority = priority.sum(axis=1, keepdims=True)
        protected = protected.any(axis=1, keepdims=True)
    key = mx.where(protected, mx.inf, priority)
    return _ext.top_rows(key if key.dtype == mx.float32 else key.astype(mx.float32), count, capacity)


def entry_priority(scorer, acc, positions, offset, scoreless: bool, *content) -> mx.array:
    """The scorer's priority, or recency for a cache that saw no attention (it keeps the newest)."""
    if scoreless:
        return positions.astype(mx.float32)
    return scorer.priority(acc, positions, offset, *content)


_EVICTION_PLANS = {}
_last_plans = (None, None, None, None, None)  # (budget, scorer, scoreless, masked, plans) of the last call


def eviction_plan(budget, scorer, scoreless: bool, group=None, masked: bool = False):
    """plan(acc, positions, offset, recent_from, keep, capacity, *content[, dead]) -> (B, H, capacity)
    indices of the entries to keep (ascending), padded for a gather into buffers of `capacity` rows:
    the scorer's priorities (`content` is Lane.content() when the scorer reads keys, else empty), with
    the budget's protected entries (recent: positions >= recent_from) forced in; `masked`: the last
    argument marks dead rows, never kept (ColumnedKV.dead_rows). Compiled once per
    configuration and shape and shared by every layer: ~15 small ops per layer and step become one
    fused call (150 -> 46 µs at M = 512). Tensor parallel (`group`), a set shared by the heads
    (select='layer') ranks the priorities summed over every rank's heads: the plan all-reduces
    between its two compiled halves, and every rank keeps the positions one rank would."""
    global _last_plans
    shared = budget.select == "layer"
    last = _last_plans
    # The same objects as the last call's is the usual case: every layer shares the policy's budget
    # and scorer, and hashing those two dataclasses cost ~8 µs a compaction.
    if last[0] is budget and last[1] is scorer and last[2] == scoreless and last[3] == masked:
        plan, priorities, choose = last[4]
    else:
        key = (budget, scorer, scoreless, masked)
        if key not in _EVICTION_PLANS:

            def priorities(acc, positions, offset, *content):
                priority = entry_priority(scorer, acc, positions, offset, scoreless, *content)
                return priority.sum(axis=1, keepdims=True) if shared else priority

            def choose(priority, positions, recent_from, keep, capacity, *dead):
                idx = select_entries(priority, budget.protected(positions, recent_from), keep, shared, *dead, capacity=capacity)
                return mx.broadcast_to(idx, (*positions.shape[:2], idx.shape[2])) if shared else idx

            def plan(acc, positions, offset, recent_from, keep, capacity, *rest):
                content, dead = _content_and_dead(rest, masked)
                return choose(priorities(acc, positions, offset, *content), positions, recent_from, keep, capacity, *dead)

            _EVICTION_PLANS[key] = mx.compile(plan), mx.compile(priorities), mx.compile(choose)
        _last_plans = (*key, _EVICTION_PLANS[key])
        plan, priorities, choose = _EVICTION_PLANS[key]
    if group is None or not shared:
        return plan

    def across_ranks(acc, positions, offset, recent_from, keep, capacity, *rest):
        content, dead = _content_and_dead(rest, masked)
        priority = all_sum(priorities(acc, positions, offset, *content), group)
        return choose(priority, positions, recent_from, keep, capacity, *dead)

    return across_ranks


def _content_and_dead(rest: tuple, masked: bool):
    """A plan's trailing arguments as (content, (dead,) or ())."""
    return (rest[:-1], rest[-1:]) if masked else (rest, ())


def choose_entries(lanes, shape, budget, scorer, offset: int, keep: int, capacity: int, recent: int, scoreless: bool, scale,
                   group=None):
    """[(lane, indices of the entries it keeps, how many)] for an eviction to `keep` entries per head:
    one compiled plan for a layer-wide lane (padded to `capacity`); with per-head lanes, one budget of
    H x keep per batch row shared by priority (spread.adaptive_lane_selection). `group`: the ranks
    holding the layer's other heads (tensor parallel), for the choices the heads share."""
    content = [lane.content(scale) if scorer.uses_keys and not scoreless else () for lane in lanes]
    if budget.head_budget != "adaptive":  # one lane; adaptive heads are a lane each (one on a rank holding one head)
        store = lanes[0].store
        acc, pos, dead = store.column("acc"), store.column("pos"), store.dead_rows()
        plan = eviction_plan(budget, scorer, scoreless, group, dead is not None)
        masked = () if dead is None else (dead,)
        return [(lanes[0], plan(acc, pos, mx.array(offset, mx.int32), mx.array(offset - recent, mx.int32), keep, capacity, *content[0], *masked),
                 keep)]
    pos = [lane.store.column("pos") for lane in lanes]
    priorities = [entry_priority(scorer, lane.store.column("acc"), p, offset, scoreless, *c) for lane, p, c in zip(lanes, pos, content)]
    protected = [budget.protected(p, offset - recent) for p in pos]
    return adaptive_lane_selection(lanes, shape, priorities, protected, keep, budget.heavy, group)
