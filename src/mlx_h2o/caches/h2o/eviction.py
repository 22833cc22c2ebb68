"""Which entries an eviction keeps: the scorer's priorities, the budget's protected entries, and the
highest priorities for the rest, per kv head or per layer (`select`)."""

import mlx.core as mx

from ...storage import pad_indices
from .spread import adaptive_lane_selection


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


def entry_priority(scorer, acc, positions, offset, scoreless: bool, *content) -> mx.array:
    """The scorer's priority, or recency for a cache that saw no attention (it keeps the newest)."""
    if scoreless:
        return positions.astype(mx.float32)
    return scorer.priority(acc, positions, offset, *content)


_EVICTION_PLANS = {}


def eviction_plan(budget, scorer, scoreless: bool):
    """plan(acc, positions, offset, recent_from, keep, capacity, *content) -> (B, H, capacity)
    indices of the entries to keep (ascending), padded for a gather into buffers of `capacity` rows:
    the scorer's priorities (`content` is Lane.content() when the scorer reads keys, else empty), with
    the budget's protected entries (recent: positions >= recent_from) forced in. Compiled once per
    configuration and shape and shared by every layer: ~15 small ops per layer and step become one
    fused call (150 -> 46 µs at M = 512)."""
    key = (budget, scorer, scoreless)
    if key not in _EVICTION_PLANS:

        def plan(acc, positions, offset, recent_from, keep, capacity, *content):
            priority = entry_priority(scorer, acc, positions, offset, scoreless, *content)
            idx = select_entries(priority, budget.protected(positions, recent_from), keep, budget.select == "layer")
            return pad_indices(mx.broadcast_to(idx, (*acc.shape[:2], keep)), capacity)

        _EVICTION_PLANS[key] = mx.compile(plan)
    return _EVICTION_PLANS[key]


def choose_entries(lanes, shape, budget, scorer, offset: int, keep: int, capacity: int, recent: int, scoreless: bool, scale):
    """[(lane, indices of the entries it keeps, how many)] for an eviction to `keep` entries per head:
    one compiled plan for a layer-wide lane (padded to `capacity`); with per-head lanes, one budget of
    H x keep per batch row shared by priority (spread.adaptive_lane_selection)."""
    content = [lane.content(scale) if scorer.uses_keys and not scoreless else () for lane in lanes]
    if len(lanes) == 1:
        acc, pos = lanes[0].store.column("acc"), lanes[0].store.column("pos")
        plan = eviction_plan(budget, scorer, scoreless)
        return [(lanes[0], plan(acc, pos, mx.array(offset, mx.int32), mx.array(offset - recent, mx.int32), keep, capacity, *content[0]), keep)]
    pos = [lane.store.column("pos") for lane in lanes]
    priorities = [entry_priority(scorer, lane.store.column("acc"), p, offset, scoreless, *c) for lane, p, c in zip(lanes, pos, content)]
    protected = [budget.protected(p, offset - recent) for p in pos]
    return adaptive_lane_selection(lanes, shape, priorities, protected, keep, budget.heavy)
