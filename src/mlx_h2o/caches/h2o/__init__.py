"""The "h2o" policy: a heavy-hitter KV cache (Zhang et al., 2023) for every mlx-lm model, in parts:
options.py (the option table and H2OConfig), scoring.py (how attention becomes priority),
eviction.py (when, how many, which), budgets.py (how the budget is spread over layers and heads),
cache.py (H2OKVCache), adaptive.py (per-head budgets), policy.py (the policy)."""

from . import policy  # noqa: F401  (registers the policy)
from .adaptive import AdaptiveHeadsKVCache
from .archive import ArchiveKVCache
from .cache import H2OKVCache, make_storage
from .eviction import eviction_plan, select_entries
from .options import OPTIONS, H2OConfig
from .scoring import SCORE_RULES

__all__ = ["AdaptiveHeadsKVCache", "ArchiveKVCache", "H2OConfig", "H2OKVCache", "OPTIONS", "SCORE_RULES", "eviction_plan", "make_storage", "select_entries"]
