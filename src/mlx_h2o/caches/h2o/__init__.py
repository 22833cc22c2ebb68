"""The "h2o" policy: a heavy-hitter KV cache (Zhang et al., 2023) for every mlx-lm model, composed of
parts, each a frozen dataclass whose fields are its options: budget.py (how many entries, which are
protected, when to evict), scorer.py (how attention becomes priority; the rules in scoring.py),
keeper.py (drop, merge or archive what is evicted), storage.py (the rows' format). options.py joins
them into `H2OConfig` and the option table; cache.py is `H2OKVCache`, which works on lanes
(lane.py); eviction.py picks the entries, spread.py spreads M over layers and heads, batch.py
batches sequences, policy.py registers the policy."""

from . import policy  # noqa: F401  (registers the policy)
from .budget import Budget
from .cache import H2OKVCache
from .eviction import eviction_plan, select_entries
from .keeper import Keeper
from .options import OPTIONS, H2OConfig
from .scorer import Scorer
from .scoring import SCORE_RULES
from .storage import Storage

__all__ = ["Budget", "H2OConfig", "H2OKVCache", "Keeper", "OPTIONS", "SCORE_RULES", "Scorer", "Storage", "eviction_plan", "select_entries"]
