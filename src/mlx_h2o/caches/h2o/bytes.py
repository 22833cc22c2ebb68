"""A byte budget (`max_kv_bytes`): the configuration an h2o cache picks for a number of bytes per
sequence, and the M that fits them.

The rule (docs/h2o.md, "Byte budget") is a table keyed by the budget in tokens of the full cache,
t = bytes per sequence / the full cache's bytes per token (all h2o layers, K and V, the model's
dtype), chosen on the tuning document set 0 only (docs/results/h2o-methods): at t = 128 and 256,
heavy hitters at 4 bits with the recent window at 8, rotated, and no archive had the lowest
perplexity of every cache of the same bytes; at t = 205 and 410 (10 % and 20 % of 2048 tokens),
the same with only the newest 64 rows at 8 bits and a quarter of M for heavy hitters
(`kv_recent_rows=64, split=balanced`) has the lowest perplexity at 205 and the best needle and
passkey recall at both; and a float32 model's rows kept as float16 before packing, with a scale
per 64 values, buy 18-29 % more entries for a lower perplexity at 205 and 256; keys stored less their
mean, with the sink rows at 8 bits, lower it again at 205 and 256. Packed rows need a
head dimension the group size divides (64, else 32); otherwise the rows stay dense (in `kv_dtype`:
unset, float16 for a float32 model, as in every policy).

M is then the largest whose worst case fits the bytes (`layer_bound`): every row at its stored
bits, the per-entry columns, the low tier's reservation and the high tier's window plus one step,
the archive with room for one eviction. The cache never holds more than M entries at any moment,
because a multi-token call is appended and attended in steps of `evict_every` tokens (cache.py), so
no prefill chunk size needs assuming. Options the user gives win over the table: kv_bits (with
rotate, center_keys, kv_recent_rows, kv_sink_rows, kv_group_size and kv_dtype as given),
kv_group_size, kv_dtype, split, and evicted_bits / evicted_share; M is always the rule's.
"""

from dataclasses import dataclass
from typing import Optional, Tuple

import mlx.core as mx

from ...storage import role_bits
from .budget import DEFAULT_SPLIT
from .keeper import BOOKKEEPING_BYTES
from .storage import DEFAULT_GROUP_SIZE, row_bytes


@dataclass(frozen=True)
class ByteRule:
    """One row of the table: the configuration for budgets of at least `min_tokens` tokens of the
    full cache (packed rows: where kv_group_size divides the head dimensions).

    Parameters
    ----------
    min_tokens:
        the smallest budget, in tokens of the full cache, the row applies to.
    kv_bits, rotate, kv_recent_rows, kv_sink_rows, center_keys, kv_group_size, evicted_bits, evicted_share:
        the storage and the archive (keeper.py, storage.py) the row picks.
    kv_dtype:
        the dtype a float32 model's rows are kept in before packing (their scales and biases take
        it); a model computing in 2-byte floats keeps its own.
    split:
        how M divides into heavy hitters and the recent window (budget.py).
    """

    min_tokens: float
    kv_bits: Optional[str]
    rotate: bool
    kv_recent_rows: Optional[int] = None
    kv_sink_rows: Optional[int] = None
    center_keys: bool = False
    kv_group_size: int = DEFAULT_GROUP_SIZE
    kv_dtype: Optional[str] = None
    split: str = DEFAULT_SPLIT
    evicted_bits: Optional[str] = None
    evicted_share: float = 0.5

    def applies(self, tokens: float, head_dims: Tuple[int, int], group_size: Optional[int]) -> bool:
        """Whether the row serves `tokens` and head dims its packing can group (by `group_size`, the
        user's, or else the row's own)."""
        packs = self.kv_bits is not None or self.evicted_bits is not None
        group = group_size or self.kv_group_size
        return tokens >= self.min_tokens and (not packs or all(d % group == 0 for d in head_dims))


# First row that applies wins. Set 0, ΔPPL vs the full cache at the bytes of an fp32 window of 128 /
# 256 tokens (ppl_bytes_set0.json, ppl_bytes8_set0.json, ppl_bytes_combo_set0.json, ppl_set0.json):
# 4/8 rotated +8.13 % / +1.15 %; 4-bit rotated h2o +10.27 % / +6.09 %; 8-bit window +11.59 % / +2.96 %;
# 4/8 rotated + 2-bit archive +15.48 % / +5.59 %; fp32 h2o (t = 128 / 256) +40.02 % / +20.79 %.
#
# At 10 % and 20 % of the full cache's bytes at 2048 tokens (t = 205 / 410; ppl_bytes_recent_set0.json,
# recall_bytes_recent_set0.json): keeping only the newest 64 rows at 8 bits buys ~23 % more entries
# (M 719 -> 884 at t = 205), and a quarter of M for heavy hitters (split=balanced) keeps a longer
# recent window: ΔPPL +3.85 % -> +1.76 % at t = 205, +0.30 % -> +0.50 % at t = 410; needle / passkey
# found (share of the full cache's hits) 0 / 20 % -> 50 / 20 % at t = 205, 50 / 60 % -> 100 / 100 %
# at t = 410. One row for every t: it wins both at t = 205 and trades 0.2 points of ΔPPL for recall at 410.
#
# Rows kept as float16 before packing (scales and biases at 2 bytes, not a float32 model's 4) with a
# scale per 64 values (head dim 64: one per row) buy 18 % / 29 % more entries (M 1114 -> 1310 / 1435
# at t = 256), and rotated rows lose little to the coarser scale: ΔPPL at t = 205 / 256 / 410
# +1.72 / +1.03 / +0.52 % -> float16 +1.09 / +0.69 / +0.43 %, group 64 +1.25 / +0.80 / +0.55 %,
# both +0.90 / +0.55 / +0.50 % (ppl_bytes_f16_set0.json). Both win at 205 and 256; at 410 float16
# alone is 0.07 points better, within the spread of 4 documents: one row.
#
# Keys stored less their mean (centre fixed when rows first leave the 8-bit window) with the 4 sink
# rows kept at 8 bits: ΔPPL at t = 205 / 256 / 410 +1.27 / +0.70 / +0.63 % -> +0.94 / +0.59 / +0.62 %
# (ppl_center_sinks_set0.json; 7 policies a run, the int8-activation path, hence higher than the
# numbers above). Either alone lost at 256 (ppl_center_set0.json): centred keys +1.19 % (the sink
# rows, far from the mean, then round worse and take the most attention), 8-bit sink rows +0.73 %.
BYTE_RULES = (
    ByteRule(0, "4/8", True, kv_recent_rows=64, kv_sink_rows=4, center_keys=True, kv_group_size=64, kv_dtype="float16", split="balanced"),
    ByteRule(0, "4/8", True, kv_recent_rows=64, kv_sink_rows=4, center_keys=True, kv_group_size=32, kv_dtype="float16",
             split="balanced"),  # head dims 64 does not divide
    ByteRule(0, None, False),  # head dims kv_group_size does not divide: the model's dtype
)


def rule_for(tokens: float, head_dims, group_size: Optional[int] = None) -> ByteRule:
    return next(r for r in BYTE_RULES if r.applies(tokens, tuple(head_dims), group_size))


def full_token_bytes(heads: int, head_dims, itemsize: int) -> int:
    """One token of one layer in the full cache: K and V rows of every kv head, the model's dtype."""
    return heads * sum(head_dims) * itemsize


def layer_bound(config, heads: int, head_dims, itemsize: int) -> int:
    """The most bytes one sequence's cache of one layer can hold under `config` (M resolved), with
    calls appended in steps of at most evict_every (cache.py): see the module docstring."""
    budget, archived = config.keeper.split(config.budget, config.storage, tuple(head_dims), itemsize)
    M, step = budget.max_kv_size, budget.evict_every
    dims = (*head_dims, config.storage.group_size, itemsize)
    older, recent = config.storage.tiers()
    if role_bits(older) == role_bits(recent):
        rows = M * row_bytes(older, *dims)
    else:  # low tier reserves M - window (WindowTieredKV); the high tier holds the window + one step before demoting
        window = min(config.storage.high_rows(config.budget.recent), M)
        sinks = config.storage.sink_rows(budget.sink)  # the first rows in the high format too (SinkRowsKV)
        high = min(window + step, M - sinks) + sinks  # (the tiers hold the M - sinks other rows)
        rows = (M - window - sinks) * row_bytes(older, *dims) + high * row_bytes(recent, *dims)
    columns = M * (BOOKKEEPING_BYTES + (4 if config.keeper.merge is not None else 0))  # + float32 multiplicity
    if config.storage.center_keys:
        columns += 2 * head_dims[0] * 4  # the float32 mean key, in the model's and the stored space (CenteredKeysKV)
    archive = (archived + step) * (row_bytes(config.keeper.archive_format, *dims) + BOOKKEEPING_BYTES) if archived else 0
    return heads * (rows + columns + archive)


def _config_at(options: dict, M: int):
    from .options import H2OConfig

    try:
        return H2OConfig.from_checked({**options, "max_kv_size": M})
    except ValueError:  # M too small for these options (sink, evict_every, the archive's share)
        return None


def resolve(config, layer_bytes: int, heads: int, head_dims, itemsize: int, total=None, layers: int = 1):
    """The resolved H2OConfig for `layer_bytes` per sequence in one layer of `heads` kv heads of a
    model computing in `itemsize`-byte floats: the table's configuration where the user left it
    open, and the largest M that fits. `total` (the user's max_kv_bytes, over `layers` layers)
    phrases the error when nothing fits."""
    options = config.options()
    rule = rule_for(layer_bytes / full_token_bytes(heads, head_dims, itemsize), head_dims, options["kv_group_size"])
    if options["kv_bits"] is None:
        # (an archive the user asks for keeps its rows as read: not centred)
        options.update(kv_bits=rule.kv_bits, rotate=rule.rotate, center_keys=rule.center_keys and options["evicted_bits"] is None)
        for name in ("kv_recent_rows", "kv_sink_rows", "kv_group_size"):
            if options[name] is None:
                options.update({name: getattr(rule, name)})
        if options["kv_dtype"] is None and rule.kv_dtype is not None and itemsize > getattr(mx, rule.kv_dtype).size:
            options.update(kv_dtype=rule.kv_dtype)
    stored = itemsize if options["kv_dtype"] is None else getattr(mx, options["kv_dtype"]).size  # rows and scales as kept
    if options["split"] is None:
        options.update(split=rule.split)
    if options["evicted_bits"] is None:
        options.update(evicted_bits=rule.evicted_bits, evicted_share=rule.evicted_share)

    def fits(M):
        c = _config_at(options, M)
        return c is not None and layer_bound(c, heads, head_dims, stored) <= layer_bytes

    low = next((M for M in range(1, 4097) if _config_at(options, M) is not None), None)
    if low is None or not fits(low):
        need = None if low is None else layer_bound(_config_at(options, low), heads, head_dims, stored) * layers
        given = total if total is not None else layer_bytes
        smallest = "" if need is None else (f"; the smallest that works here is {given.in_unit(need) if hasattr(given, 'in_unit') else need} "
                                           f"({need} bytes: M = {low})")
        raise ValueError(f"max_kv_bytes={_shown(given)} is too small for any h2o configuration of this model "
                         f"({layers} h2o layers x {heads} kv heads, head dims {tuple(head_dims)}){smallest}")
    high = low  # the bound grows with M: double, then bisect
    while fits(high * 2):
        high *= 2
    lo, hi = high, high * 2  # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return _config_at(options, lo)


def _shown(value) -> str:
    unit = getattr(value, "unit", "B")
    return f"{value} bytes" if unit == "B" else f"{value.in_unit(int(value))} ({int(value)} bytes)"
