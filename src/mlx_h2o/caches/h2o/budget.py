"""The budget of an h2o cache: how many entries it keeps, which of them are protected, and when it
evicts. All of it is a function of the entries held (`length`), the tokens processed (`offset`) and
the tokens about to be appended (`L`), so `make_mask` plans exactly the eviction `update_and_fetch`
carries out. How M is spread over layers and heads is in spread.py."""

from dataclasses import dataclass, replace
from typing import Optional, Tuple

import mlx.core as mx

from ...options import REQUIRED, Bytes, Choice, Custom, Int, check_int, option
from ...storage import grown_capacity

SPLITS = ("heavy", "balanced", "recent", "window", "explicit")
# Fraction of M given to heavy hitters by each preset; the rest after the sinks is the recent window.
# `window` keeps no heavy hitters: a sliding window with sinks, in the h2o cache's storage (packed,
# rotated, at a byte budget), the baseline an equal-bytes comparison needs.
SPLIT_HEAVY_FRACTION = {"heavy": 1 / 2, "balanced": 1 / 4, "recent": 1 / 8, "window": 0}
DEFAULT_SPLIT = "heavy"  # (a byte budget's comes from the byte rule, bytes.py)
# Default evict_every = M // 16: a compaction (~0.2 ms a layer on the CPU, most of it fixed cost) once per
# M/16 tokens instead of every token, for ~3 % fewer entries held on average (docs/h2o.md, "eviction").
DEFAULT_EVICT_DIVISOR = 16


def _check_byte_budget(split, pin, rest) -> None:
    """A byte budget bounds every entry the cache holds, so it sizes one M for every layer and head,
    and nothing may live outside M."""
    if split == "explicit":
        raise ValueError("max_kv_bytes chooses M, so heavy and recent come from split (heavy, balanced, recent or window), not split='explicit'")
    if pin:
        raise ValueError("max_kv_bytes bounds every entry held; pinned spans live outside the budget: give max_kv_size to pin")
    if rest.get("layer_budget", "uniform") != "uniform" or rest.get("head_budget", "uniform") != "uniform":
        raise ValueError("max_kv_bytes sizes one M for every layer and kv head: it needs layer_budget='uniform' and head_budget='uniform'")


def _parse_spans(name, text: str):
    """"0:40;100:120" (or space-separated) -> [(0, 40), (100, 120)]."""
    try:
        return [tuple(int(x) for x in part.split(":")) for part in text.replace(";", " ").split()]
    except ValueError:
        raise ValueError(f"{name} must be START:END spans separated by ';', got {text!r}") from None


def _check_spans(name, pin) -> Tuple[Tuple[int, int], ...]:
    """Pinned spans as sorted, merged, half-open (start, end) token ranges."""
    if isinstance(pin, str):
        pin = _parse_spans(name, pin)
    spans = []
    for span in pin:
        ok = isinstance(span, (tuple, list)) and len(span) == 2 and all(not isinstance(v, bool) and isinstance(v, int) for v in span)
        if not ok or not 0 <= span[0] < span[1]:
            raise ValueError(f"{name} must be (start, end) token ranges with 0 <= start < end, got {span!r}")
        spans.append((int(span[0]), int(span[1])))
    merged = []
    for s, e in sorted(spans):
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return tuple(merged)


@dataclass(frozen=True)
class Budget:
    """How many entries a layer keeps per kv head, and which are protected.

    Parameters
    ----------
    max_kv_size, split, sink, heavy, recent:
        M = sink + heavy + recent entries: the first tokens, the highest priorities, the newest tokens.
    select:
        one set of entries per kv head, or one per layer (priorities summed over heads).
    evict_every:
        compact once per N tokens, down to M - N (never more than M held).
    layer_budget, head_budget:
        how M is spread over layers and over the kv heads of a layer (spread.py).
    pin:
        token ranges never evicted, outside M.
    max_kv_bytes:
        instead of M, bytes per sequence over all h2o layers; M (and the storage, bytes.py) is
        resolved from it when the first keys show the model's shape. Until then M is None.
    """

    max_kv_size: Optional[int] = option(Int(1), REQUIRED, "KV budget M per kv head: sink + heavy + recent entries",
                                        instead=("max_kv_bytes",))
    split: Optional[str] = option(
        Choice(SPLITS), None,
        "budget split: `heavy` (heavy hitters M/2), `balanced` (M/4), `recent` (M/8), `window` (none: a sliding window "
        "with sinks), `explicit` (give heavy and recent); unset: `heavy`, or with max_kv_bytes the byte rule's")
    sink: int = option(Int(0), 4, "first tokens always kept")
    heavy: Optional[int] = option(Int(0), None, "heavy-hitter entries (with split=explicit)")
    recent: Optional[int] = option(Int(0), None, "recent-window entries (with split=explicit)")
    select: str = option(Choice(("head", "layer")), "head", "keep one set of entries per kv head, or one per layer")
    evict_every: Optional[int] = option(
        Int(1), None, "evict N entries at a time, down to M - N: one compaction per N tokens, never more than M held (unset: M // 16)")
    layer_budget: str = option(
        Choice(("uniform", "pyramid", "dispersion")), "uniform",
        "M per layer at the same total: `uniform`, `pyramid` (1.5 M at the first layer to 0.5 M at the last; PyramidKV), "
        "`dispersion` (by the attention entropy each layer showed until the cache first filled; CAKE)")
    head_budget: str = option(
        Choice(("uniform", "adaptive")), "uniform",
        "heavy entries per kv head: `uniform` (the same per head) or `adaptive` (one budget per layer, shared by its heads by priority; Ada-KV)")
    pin: Tuple[Tuple[int, int], ...] = option(Custom(_check_spans, _parse_spans, "spans `S:E;S:E`"), None,
                                             "token ranges never evicted (outside the budget)")
    max_kv_bytes: Optional[int] = option(
        Bytes(), None,
        "instead of max_kv_size: KV bytes per sequence over all h2o layers; picks kv_bits, rotate, kv_group_size, kv_dtype, the archive and M "
        "for them and never holds more (docs/h2o.md#byte-budget)")

    @classmethod
    def from_options(cls, max_kv_size, split, sink, heavy, recent, evict_every, pin, **rest) -> "Budget":
        """Resolve what the options leave open: heavy and recent from `split`, evict_every from M. A
        byte budget without M stays unresolved (M None) until the model's shape is known (bytes.py)."""
        M = max_kv_size
        if M is None:
            if rest.get("max_kv_bytes") is None:
                raise ValueError("policy 'h2o' needs a budget: max_kv_size (entries per kv head) or max_kv_bytes (bytes per sequence)")
            _check_byte_budget(split, pin, rest)
            return cls(max_kv_size=None, split=split, sink=sink, heavy=heavy, recent=recent, evict_every=evict_every, pin=pin or (), **rest)
        sink = check_int("sink", sink, 0, M - 1)
        split = split or DEFAULT_SPLIT
        if split == "explicit":
            if heavy is None or recent is None:
                raise ValueError("split='explicit' needs heavy and recent (sink defaults to 4), with sink + heavy + recent = max_kv_size")
        elif heavy is not None or recent is not None:
            raise ValueError(f"heavy and recent are set by split={split!r}; give split='explicit' to choose them")
        else:
            heavy = min(int(M * SPLIT_HEAVY_FRACTION[split]), M - sink)
            recent = M - sink - heavy
        if evict_every is None:
            evict_every = min(max(M // DEFAULT_EVICT_DIVISOR, 1), M - sink)
        return cls(max_kv_size=M, split=split, sink=sink, heavy=heavy, recent=recent, evict_every=evict_every, pin=pin or (), **rest)

    @property
    def resolved(self) -> bool:
        """M is known (a byte budget resolves it at the first keys)."""
        return self.max_kv_size is not None

    def __post_init__(self):
        M = self.max_kv_size
        if M is None:  # a byte budget, resolved later (bytes.py builds the resolved budget, checked here)
            return
        if self.sink + self.heavy + self.recent != M:
            raise ValueError(f"sink + heavy + recent must equal max_kv_size={M}, got {self.sink} + {self.heavy} + {self.recent}")
        # An eviction keeps at least the sink entries of the old context: M - evict_every >= sink.
        check_int("evict_every", self.evict_every, 1, M - self.sink)
        if self.head_budget == "adaptive" and self.select == "layer":
            raise ValueError("head_budget='adaptive' gives each kv head its own entries; select='layer' keeps one set for all")

    def check(self, config) -> None:
        if self.layer_budget == "dispersion" and config.scorer.rule.op_scores != "mass":
            raise ValueError(f"layer_budget='dispersion' measures attention mass; score={config.scorer.score!r} sees logits")

    def for_layer(self, budget: int) -> "Budget":
        """This budget with M = `budget` for one layer: the recent window keeps its size while the
        budget allows, the heavy part takes the rest."""
        budget = max(int(budget), self.sink + 1)
        heavy = max(budget - self.sink - self.recent, 0)
        return replace(self, max_kv_size=budget, heavy=heavy, recent=budget - self.sink - heavy,
                       evict_every=min(self.evict_every, budget - self.sink))

    # ------------------------------------------------------------------ when and how many
    def keep_count(self, length: int, offset: int, L: int, phase: Optional[int] = None) -> Optional[int]:
        """Entries of the current layout to keep before appending L tokens, or None for no eviction.
        The cache fills up to M entries (plus pinned ones); the token that would pass M triggers one
        compaction down to M - evict_every, so decode compacts once per `evict_every` tokens and never
        holds more than M. A call of L > 1 tokens (a prefill chunk) is appended whole after it.

        `phase` staggers the layers' compactions (one layer's at a time, not all of them in one decode
        step; the h2o policy gives layer i its own phase): the layer also compacts at the decode
        steps where (offset + phase) % evict_every == 0 once it holds more than M - evict_every,
        which is where its compactions then stay. A multi-token call compacts every staggered layer
        holding more than M - evict_every, so the layers hold the same entries count after it
        (the mask one layer plans is every layer's)."""
        pinned, M, every = self.pinned_before(offset), self.max_kv_size, self.evict_every
        due = length + L > M + pinned
        if phase is not None and length > M - every + pinned:
            due |= L > 1 or (offset + phase) % every == 0
        if not due:
            return None
        keep = min(length - pinned, M - every) + pinned
        return keep if keep < length else None

    def evict_phase(self, layer: int, layers: int) -> int:
        """The phase (keep_count) of layer `layer` of `layers`: the layers' compactions spread evenly
        over the evict_every decode steps between two of one layer's."""
        return layer * self.evict_every // max(layers, 1) % self.evict_every

    def recent_kept(self, offset: int, keep: int) -> int:
        """Entries of the recent window an eviction to `keep` protects (the new tokens complete it);
        they are the newest entries, the tail of the layout. The one statement of the window."""
        return max(keep - self.pinned_before(offset) - self.sink - self.heavy, 0)

    def buffer_capacity(self, offset: int, needed: int) -> int:
        """Rows to allocate for `needed` entries: the steady-state size (M + pinned) once reached,
        storage growth steps below it, exactly `needed` above it (a prefill chunk)."""
        steady = self.max_kv_size + self.pinned_before(offset + 1)
        return needed if needed > steady else min(steady, grown_capacity(needed))

    # ------------------------------------------------------------------ which
    def protected(self, positions: mx.array, recent_from) -> mx.array:
        """Entries every eviction keeps: the sink, the recent window (positions >= recent_from) and
        the pinned spans."""
        mask = (positions < self.sink) | (positions >= recent_from)
        for s, e in self.pin:
            mask = mask | ((positions >= s) & (positions < e))
        return mask

    def pinned_before(self, offset: int) -> int:
        """How many pinned positions lie in [0, offset)."""
        if not self.pin:  # (read three times per layer and decode step)
            return 0
        return sum(max(0, min(e, offset) - s) for s, e in self.pin)
