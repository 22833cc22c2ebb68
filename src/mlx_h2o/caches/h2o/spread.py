"""How the h2o budget is spread: over layers (`layer_budget`) and over the kv heads of a layer
(`head_budget`), always at the total of the uniform cache (M entries per head and layer), so every
comparison is at the same memory.

- `pyramid` (PyramidKV): a fixed linear schedule, (1 + PYRAMID_SLOPE) M at the first layer down to
  (1 - PYRAMID_SLOPE) M at the last; lower layers attend more broadly.
- `dispersion` (CAKE): each layer's share follows the entropy of its attention (in nats, averaged
  over the calls and heads it served) until the cache first fills, when the budgets are fixed once
  for all layers. CAKE also weighs the temporal variance of attention; this uses the entropy alone.
- head `adaptive` (Ada-KV): one heavy-hitter budget per layer (H x heavy entries), filled jointly
  from all kv heads by priority, so a head whose attention is concentrated on few entries yields
  slots to a head that spreads it; each head keeps at least ADAKV_FLOOR of the uniform share (Ada-KV's
  safeguard). Priorities of the `normalised` rule are comparable across heads (uniform attention
  scores G in every head). Heads then hold different numbers of entries: each is a lane of its own
(lane.py).

In every case the recent window keeps its size (the newest tokens matter most); only the heavy part
grows or shrinks.
"""

from typing import List, Sequence

import mlx.core as mx
import numpy as np

from ...distributed import SharesGroup, all_sum
from .budget import Budget

PYRAMID_SLOPE = 0.5
MIN_LAYER_FRACTION = 0.25  # no layer gets less than this share of M
ADAKV_FLOOR = 0.2
FLOOR_KEY = 3.0e38  # ranks a head's floor entries above every priority, below protected ones (inf)


def split_total(total: int, weights: Sequence[float], floor: int) -> List[int]:
    """Integers >= floor, proportional to `weights` above the floor, summing to `total` (largest
    remainders)."""
    n = len(weights)
    w = np.maximum(np.asarray(weights, dtype=np.float64), 0.0)
    spare = total - floor * n
    if spare < 0:
        raise ValueError(f"a total of {total} cannot give {n} layers {floor} entries each")
    share = w / w.sum() * spare if w.sum() > 0 else np.full(n, spare / n)
    out = np.floor(share).astype(int)
    for i in np.argsort(-(share - out), kind="stable")[: spare - out.sum()]:
        out[i] += 1
    return [floor + int(x) for x in out]


def pyramid_weights(n_layers: int) -> List[float]:
    if n_layers == 1:
        return [1.0]
    return [1.0 + PYRAMID_SLOPE * (1.0 - 2.0 * i / (n_layers - 1)) for i in range(n_layers)]


def layer_budgets(budget: Budget, weights: Sequence[float]) -> List[int]:
    """Per-layer M at the uniform total (len(weights) x M), by `weights`, each >= the floor."""
    M = budget.max_kv_size
    floor = max(int(MIN_LAYER_FRACTION * M), budget.sink + 1)
    floor = min(floor, M)
    n = len(weights)
    # Weights above the floor: scale so the budgets, not just the spare, follow the weights.
    w = np.asarray(weights, dtype=np.float64)
    target = w / w.sum() * (M * n) if w.sum() > 0 else np.full(n, float(M))
    return split_total(M * n, np.maximum(target - floor, 0.0), floor)


def attention_entropy(mass: mx.array) -> mx.array:
    """Mean entropy (nats) of the attention distributions in `mass` (B, H, N) (each (b, h) row
    normalised to sum 1): how widely a layer attends."""
    p = mass / mx.maximum(mass.sum(axis=-1, keepdims=True), 1e-30)
    return -(p * mx.log(mx.maximum(p, 1e-30))).sum(axis=-1).mean()


class LayerBudgetGroup(SharesGroup):
    """The h2o caches of one model under `layer_budget="dispersion"`: they report their attention
    entropy until the first of them fills, then `allocate` fixes every layer's budget at once."""

    def __init__(self, budget: Budget, group=None):
        self.budget, self.group = budget, group  # the ranks holding the model's other heads or layers
        self.caches = []
        self.entropy: List[float] = []
        self.calls: List[int] = []
        self.allocated = False

    def add(self, cache) -> int:
        self.caches.append(cache)
        self.entropy.append(0.0)
        self.calls.append(0)
        return len(self.caches) - 1

    def observe(self, index: int, entropy: float) -> None:
        self.entropy[index] += entropy
        self.calls[index] += 1

    def allocate_before_eviction(self, keep) -> None:
        """Called by a cache before it appends rows (`keep`: its planned eviction, or None): when the
        first layer is about to evict, fix every layer's budget from the entropies seen so far (all
        layers have seen the same tokens)."""
        if keep is not None and not self.allocated:
            self.allocate()

    def allocate(self) -> None:
        # Distributed, each rank saw its own heads or layers: the sums over the group are the whole model's.
        seen = np.array(all_sum(mx.array([self.entropy, self.calls], mx.float32), self.group))
        weights = [e / max(c, 1) for e, c in zip(*seen)]
        for cache, m in zip(self.caches, layer_budgets(self.budget, weights)):
            cache.set_layer_budget(m)
        self.allocated = True


def adaptive_head_selection(priority: mx.array, protected: mx.array, valid: mx.array, keep_total: int, heavy: int) -> mx.array:
    """Ada-KV: which entries each kv head keeps when the layer keeps `keep_total` per batch row.
    priority, protected, valid: (B, H, C) (valid: the slot holds an entry). Every protected entry
    is kept, each head keeps its best ceil(ADAKV_FLOOR x heavy) unprotected entries, and the rest of
    the layer's budget goes to the highest priorities over all heads. Returns a (B, H, C) bool mask
    with keep_total True per batch row."""
    B, H, C = priority.shape
    floor = int(np.ceil(ADAKV_FLOOR * heavy))
    open_prio = mx.where(valid & ~protected, priority, -mx.inf)
    key = mx.where(valid, priority, -mx.inf)
    if floor > 0:
        kth = mx.sort(open_prio, axis=-1)[..., C - min(floor, C)][..., None]  # floor-th best per head
        key = mx.where((open_prio >= kth) & (open_prio > -mx.inf), FLOOR_KEY, key)
    key = mx.where(protected & valid, mx.inf, key).reshape(B, H * C)
    chosen = mx.argpartition(-key, kth=keep_total - 1, axis=-1)[:, :keep_total]
    mask = mx.zeros((B, H * C), mx.bool_)
    rows = mx.broadcast_to(mx.arange(B)[:, None], chosen.shape)
    mask[rows.reshape(-1), chosen.reshape(-1)] = True
    return mask.reshape(B, H, C)


def adaptive_lane_selection(lanes, shape, priorities, protected, keep: int, heavy: int, group=None):
    """[(lane, indices (1, 1, n) of its entries to keep, n)] for per-head lanes (one per (batch row,
    kv head), b-major): one budget of H x keep per batch row shared by priority
    (adaptive_head_selection). priorities, protected: per lane, (1, 1, lane length). Tensor parallel
    (`group`: the ranks holding the other heads, rank r the r-th slice), the choice is over every
    rank's heads: each gathers all of them, chooses as one rank would, and keeps its own."""
    C = max(lane.length for lane in lanes)
    if group is not None:
        C = int(mx.distributed.all_max(mx.array(C), group=group).item())  # one padded width on every rank

    def padded(xs, fill):
        x = mx.concatenate([mx.pad(x, [(0, 0), (0, 0), (0, C - x.shape[-1])], constant_values=fill) for x in xs], axis=1)
        x = x.reshape(*shape, C)
        if group is None:
            return x
        return mx.distributed.all_gather(x.swapaxes(0, 1), group=group).swapaxes(0, 1)  # (B, every rank's heads, C)

    H = shape[1] * (1 if group is None else group.size())
    valid = padded([mx.ones((1, 1, lane.length), mx.int32) for lane in lanes], 0).astype(mx.bool_)
    guard = padded([p.astype(mx.int32) for p in protected], 0).astype(mx.bool_)
    kept = adaptive_head_selection(padded(priorities, 0.0), guard, valid, H * keep, heavy)
    if group is not None:
        kept = kept[:, group.rank() * shape[1] : (group.rank() + 1) * shape[1]]
    kept = np.array(kept).reshape(-1, C)
    return [(lane, mx.array(np.nonzero(row)[0].astype(np.int32))[None, None], int(row.sum())) for lane, row in zip(lanes, kept)]
