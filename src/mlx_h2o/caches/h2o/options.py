"""The options of the h2o policy: one table (name, kind, default, help) that `make_cache` validates
against, the CLI turns into `--h2o-*` flags and the docs' option tables are generated from; and
`H2OConfig`, the validated configuration a cache runs with."""

from dataclasses import asdict, dataclass, fields
from typing import Optional, Tuple

import mlx.core as mx

from ...options import REQUIRED, Choice, Custom, Flag, Float, Int, Option, check_int, check_options
from ...storage import DEFAULT_LAMBDA, LAMBDA_MODES
from .scoring import SCORE_RULES, make_rule

SPLITS = ("heavy", "balanced", "recent", "explicit")
# Fraction of M given to heavy hitters by each preset; the rest after the sinks is the recent window.
SPLIT_HEAVY_FRACTION = {"heavy": 1 / 2, "balanced": 1 / 4, "recent": 1 / 8}
# Default evict_every = M // 16: a compaction (~0.2 ms a layer on the CPU, most of it fixed cost) once per
# M/16 tokens instead of every token, for ~3 % fewer entries held on average (docs/h2o.md, "eviction").
DEFAULT_EVICT_DIVISOR = 16
SELECTIONS = ("head", "layer")
LAYER_BUDGETS = ("uniform", "pyramid", "dispersion")
EVICTED_BITS = ("2", "3", "4", "8", "k8v4", "k4v2")
HEAD_BUDGETS = ("uniform", "adaptive")
KV_GROUP_SIZES = (32, 64, 128)
# Bits of the older rows (sink + heavy hitters) / of the recent window; "fp" = the model's dtype;
# "k8v4" = 8-bit keys with 4-bit values (keys are the sensitive half), "k4v8" the reverse.
# "mixed" = 4/8: the newest rows take most of the attention, and a row is converted once, downwards,
# when it leaves the window.
KV_BITS = ("8", "4", "8/4", "4/8", "8/fp", "4/fp", "k8v4", "k4v8", "k8v4/8", "k8v4/fp")
KV_BITS_ALIASES = (("mixed", "4/8"), (8, "8"), (4, "4"))


def _tier_bits(tier: str):
    """"fp" -> None, "8" -> 8, "k8v4" -> (8, 4): a storage format (storage/kv.py)."""
    if tier == "fp":
        return None
    if tier.startswith("k"):
        k, _, v = tier[1:].partition("v")
        return int(k), int(v)
    return int(tier)


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


OPTIONS = (
    Option("max_kv_size", Int(1), REQUIRED, "KV budget M per kv head: sink + heavy + recent entries"),
    Option("split", Choice(SPLITS), "heavy",
           "budget split: `heavy` (heavy hitters M/2), `balanced` (M/4), `recent` (M/8), `explicit` (give heavy and recent)"),
    Option("sink", Int(0), 4, "first tokens always kept"),
    Option("heavy", Int(0), None, "heavy-hitter entries (with split=explicit)"),
    Option("recent", Int(0), None, "recent-window entries (with split=explicit)"),
    Option("score", Choice(tuple(sorted(SCORE_RULES))), "normalised", "scoring rule (caches/h2o/scoring.py)"),
    Option("decay", Float(0.0, 1.0), None, "decay of the `ema` / `logit_ema` rules (unset: 0.95)"),
    Option("select", Choice(SELECTIONS), "head", "keep one set of entries per kv head, or one per layer"),
    Option("evict_every", Int(1), None,
           "evict N entries at a time, down to M - N: one compaction per N tokens, never more than M held (unset: M // 16)"),
    Option("obs_window", Int(0), 0, "score a prompt by what its last N tokens attend to (SnapKV; 0 = off)"),
    Option("obs_pool", Int(1), 7, "pooling width of the observation-window scores"),
    Option("pool", Int(1), 1, "rank an entry by the best priority within a centred window of N entries (1 = off)"),
    Option("chunk", Int(1), 1, "rank and evict contiguous chunks of N positions by their summed priority (ChunkKV; 1 = single entries)"),
    Option("expected", Float(0.0, 1.0), 0.0,
           "weight of the expected attention of future queries (running query mean and variance) in the priority (Expected Attention; 0 = off)"),
    Option("redundancy", Float(0.0, 1.0), 0.0,
           "discount for keys a newer key repeats: priority x (1 - w x cosine similarity) (R-KV; 0 = off)"),
    Option("merge", Float(-1.0, 1.0), None,
           "keep, don't drop: fold an evicted entry into the kept entry whose key is most similar when their cosine similarity "
           ">= this (K/V averaged, + log multiplicity on its logit; CaM / D2O); unset: evicted entries are dropped"),
    Option("evicted_bits", Choice(EVICTED_BITS, ((2, "2"), (3, "3"), (4, "4"), (8, "8"))), None,
           "keep, don't drop: evicted entries move to a third tier at these bits (`k8v4`: 8-bit keys, 4-bit values), "
           "attended with the rest; unset: they are dropped"),
    Option("evicted_share", Float(0.0, 1.0), 0.5,
           "with evicted_bits: the share of the bytes of M entries given to that tier (the cache keeps the rest, at equal total bytes)"),
    Option("layer_budget", Choice(LAYER_BUDGETS), "uniform",
           "M per layer at the same total: `uniform`, `pyramid` (1.5 M at the first layer to 0.5 M at the last; PyramidKV), "
           "`dispersion` (by the attention entropy each layer showed until the cache first filled; CAKE)"),
    Option("head_budget", Choice(HEAD_BUDGETS), "uniform",
           "heavy entries per kv head: `uniform` (the same per head) or `adaptive` (one budget per layer, shared by its heads by priority; Ada-KV)"),
    Option("pin", Custom(_check_spans, _parse_spans, "spans `S:E;S:E`"), None,
           "token ranges never evicted (outside the budget)"),
    Option("kv_bits", Choice(KV_BITS, KV_BITS_ALIASES), None,
           "store K/V packed: 8, 4, `k8v4` (8-bit keys, 4-bit values), or OLDER/RECENT formats (`fp` = model dtype; `mixed` = 4/8); unset: model dtype"),
    Option("kv_group_size", Choice(KV_GROUP_SIZES), 32, "values sharing one scale and bias when packed"),
    Option("rotate", Flag(), False, "rotate K/V (sign x Hadamard/DFT) before packing: better low-bit quality"),
    Option("rotate_lam", Choice(LAMBDA_MODES, ((None, "none"),)), DEFAULT_LAMBDA, "per-coordinate scale of the rotation"),
)


@dataclass(frozen=True)
class H2OConfig:
    """The validated options of one h2o cache (see OPTIONS); heavy and recent resolved from split."""

    max_kv_size: int
    split: str
    sink: int
    heavy: int
    recent: int
    score: str
    decay: Optional[float]
    select: str
    evict_every: int
    obs_window: int
    obs_pool: int
    pool: int
    chunk: int
    expected: float
    redundancy: float
    merge: Optional[float]
    evicted_bits: Optional[str]
    evicted_share: float
    layer_budget: str
    head_budget: str
    pin: Tuple[Tuple[int, int], ...]
    kv_bits: Optional[str]
    kv_group_size: int
    rotate: bool
    rotate_lam: str

    @classmethod
    def build(cls, max_kv_size=None, **options) -> "H2OConfig":
        """Check `options` against the table, then the rules that tie options together."""
        o = check_options("h2o", OPTIONS, {"max_kv_size": max_kv_size, **options} if max_kv_size is not None else options)
        M = o["max_kv_size"]
        sink = check_int("sink", o["sink"], 0, M - 1)
        heavy, recent = o["heavy"], o["recent"]
        if o["split"] == "explicit":
            if heavy is None or recent is None:
                raise ValueError("split='explicit' needs heavy and recent (sink defaults to 4), with sink + heavy + recent = max_kv_size")
            if sink + heavy + recent != M:
                raise ValueError(f"sink + heavy + recent must equal max_kv_size={M}, got {sink} + {heavy} + {recent}")
        else:
            if heavy is not None or recent is not None:
                raise ValueError(f"heavy and recent are set by split={o['split']!r}; give split='explicit' to choose them")
            heavy = min(int(M * SPLIT_HEAVY_FRACTION[o["split"]]), M - sink)
            recent = M - sink - heavy
        rule = make_rule(o["score"], o["decay"])  # decay must suit the rule
        if o["head_budget"] == "adaptive":
            clash = {"select='layer'": o["select"] == "layer", "obs_window": o["obs_window"] > 0,
                     "expected": o["expected"] > 0, "redundancy": o["redundancy"] > 0, "rotate": o["rotate"],
                     "merge": o["merge"] is not None}
            if any(clash.values()):
                raise ValueError(f"head_budget='adaptive' does not combine with {', '.join(k for k, v in clash.items() if v)}")
        if o["evicted_bits"] is not None:
            clash = {"merge": o["merge"] is not None, "head_budget='adaptive'": o["head_budget"] == "adaptive",
                     f"layer_budget={o['layer_budget']!r}": o["layer_budget"] != "uniform"}
            if any(clash.values()):
                raise ValueError(f"evicted_bits does not combine with {', '.join(k for k, v in clash.items() if v)}")
            if M - round(o["evicted_share"] * M) <= sink:
                raise ValueError(f"evicted_share={o['evicted_share']} leaves no entry beyond the sink in the cache")
        if o["merge"] is not None and o["kv_bits"] is not None and "/" in str(o["kv_bits"]):
            raise ValueError("merge rewrites kept rows in place: it needs one storage format (kv_bits without a '/')")
        if o["layer_budget"] == "dispersion" and rule.op_scores != "mass":
            raise ValueError(f"layer_budget='dispersion' measures attention mass; score={o['score']!r} sees logits")
        # An eviction keeps at least the sink entries of the old context: M - evict_every >= sink.
        evict_every = o["evict_every"]
        if evict_every is None:
            evict_every = min(max(M // DEFAULT_EVICT_DIVISOR, 1), M - sink)
        check_int("evict_every", evict_every, 1, M - sink)
        return cls(**{**o, "heavy": heavy, "recent": recent, "evict_every": evict_every, "pin": o["pin"] or ()})

    def tiers(self) -> Tuple[Optional[int], Optional[int]]:
        """(bits of the older rows, bits of the recent window); None = the model's dtype."""
        if self.kv_bits is None:
            return None, None
        older, _, recent = self.kv_bits.partition("/")
        return _tier_bits(older), _tier_bits(recent or older)

    def evicted_format(self):
        """The third tier's storage format (storage/kv.py), or None when evicted entries are dropped."""
        return None if self.evicted_bits is None else _tier_bits(self.evicted_bits)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "H2OConfig":
        d = {f.name: d[f.name] for f in fields(cls)}
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
