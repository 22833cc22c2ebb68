"""Scoring rules for the H2O cache: how the attention a cached entry receives becomes the priority
it is kept by.

Every attention call hands the rule one statistic per cached entry and kv head, averaged over the
call's query rows (`stats`, shape (B, H, N)): the post-softmax attention mass (summed over the query
heads sharing the kv head), or for `logit_ema` the mean |pre-softmax logit|. A rule folds it into a
running accumulator, acc <- alpha * acc + beta * stats with the call's `coefficients` (one fused op,
ColumnedKV.accumulate), and turns the accumulator into the priority that eviction ranks by
(`priority`). New entries start with an accumulator of 0.

Each rule is a few lines; add one with `@register_score`.
"""

import functools
from typing import Dict, Optional, Tuple, Type

import mlx.core as mx

SCORE_RULES: Dict[str, Type["ScoreRule"]] = {}


def register_score(cls):
    SCORE_RULES[cls.name] = cls
    return cls


class ScoreRule:
    name = ""
    op_scores = "mass"  # what to ask scaled_dot_product_attention_with_scores for
    takes_decay = False

    def __init__(self, decay: Optional[float] = None):
        self.decay = decay

    def stats(self, raw: mx.array, heads: int, rows: int) -> mx.array:
        """Op output -> per-row mean statistic per cache head, (B, heads, N) float32.

        raw is the op's "mass": (B, Hs, N) summed over query heads and rows. Hs is the number of kv
        heads of the attention call, a multiple of the cache's heads (MLA attends its one latent
        "head" with all query heads); the groups are summed so every rule sees the mass a cached
        entry received from all the query heads that read it.
        """
        mass = _group_heads(raw, heads, mx.sum)
        return mass if rows == 1 else mass / rows

    def coefficients(self, rows: int, live: float) -> Tuple[float, float]:
        """(alpha, beta) of a call of `rows` query rows that attended `live` entries on average:
        the accumulator becomes alpha * acc + beta * stats."""
        raise NotImplementedError

    @functools.cached_property  # (asked by every layer at every decode step)
    def folds_mass(self) -> bool:
        """Whether a one-row call's stats are the op's mass itself (this class's `stats`), so the
        attention op can fold them into the accumulator (its score column) with the same bits."""
        return self.op_scores == "mass" and type(self).stats is ScoreRule.stats

    def priority(self, acc: mx.array, positions: mx.array, offset: int) -> mx.array:
        return acc


def _group_heads(x: mx.array, heads: int, reduce) -> mx.array:
    B, Hs, N = x.shape
    if Hs == heads:
        return x
    if Hs % heads:
        raise ValueError(f"attention call has {Hs} kv heads, not a multiple of the cache's {heads}")
    return reduce(x.reshape(B, heads, Hs // heads, N), axis=2)


@register_score
class Cumulative(ScoreRule):
    """The H2O paper's rule: total attention mass received since the entry was cached. Favours old
    entries, which were scored while the context was short (each row's mass sums to 1 over fewer
    entries) and for more steps."""

    name = "cumulative"

    def coefficients(self, rows, live):
        return 1.0, float(rows)


@register_score
class EMA(ScoreRule):
    """Exponential moving average of the mass (decay 0.95 by default): recent attention counts most.
    A call of several rows applies the decay once per row."""

    name = "ema"
    takes_decay = True
    default_decay = 0.95

    def coefficients(self, rows, live):
        d = self.decay**rows
        return d, 1.0 - d


@register_score
class Normalised(ScoreRule):
    """Mass scaled by the number of entries the query attended (uniform attention scores 1 whatever
    the context length), averaged over the steps since the entry was cached: the mean normalised
    attention. Removes both biases of `cumulative` (short early contexts, more steps for older
    entries)."""

    name = "normalised"

    def coefficients(self, rows, live):
        return 1.0, float(rows * live)

    def priority(self, acc, positions, offset):
        # Every query row since position p saw the entry (causal): offset - p rows.
        return acc / (offset - positions).astype(mx.float32)


@register_score
class LogitEMA(ScoreRule):
    """The MLX seed's rule: EMA (decay 0.95) of |pre-softmax logit|, averaged over the query heads of
    each kv head and the call's rows. Masked logits (-inf) count as 0."""

    name = "logit_ema"
    op_scores = "logits"
    takes_decay = True
    default_decay = 0.95

    def stats(self, raw, heads, rows):
        B, Hq, L, N = raw.shape
        mag = mx.where(mx.isfinite(raw), mx.abs(raw), 0.0).mean(axis=2)  # (B, Hq, N)
        return _group_heads(mag, heads, mx.mean)

    def coefficients(self, rows, live):
        d = self.decay**rows
        return d, 1.0 - d


def make_rule(name: str, decay: Optional[float] = None) -> ScoreRule:
    if name not in SCORE_RULES:
        raise ValueError(f"score must be one of {sorted(SCORE_RULES)}, got {name!r}")
    cls = SCORE_RULES[name]
    if decay is not None and not cls.takes_decay:
        takes = sorted(n for n, c in SCORE_RULES.items() if c.takes_decay)
        raise ValueError(f"decay applies to score in {takes}, not {name!r}")
    if cls.takes_decay:
        decay = cls.default_decay if decay is None else decay
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be a number in [0, 1), got {decay!r}")
        decay = float(decay)
    return cls(decay)
