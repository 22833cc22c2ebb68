"""The "h2o" policy: one h2o cache per layer, with the budget spread over layers as
`layer_budget` says (budgets.py) and per-head budgets in `AdaptiveHeadsKVCache` (adaptive.py)."""

from ...options import Policy
from .. import per_layer_caches, register_policy
from .adaptive import AdaptiveHeadsKVCache
from .archive import ArchiveKVCache
from .budgets import LayerBudgetGroup, layer_budgets, layer_config, pyramid_weights
from .cache import H2OKVCache
from .options import OPTIONS, H2OConfig


def _h2o_caches(model, **options):
    """An h2o cache on every plain KVCache layer (sliding-window and other special layers keep the
    model's own cache); layer i's rotation is seeded with i."""
    config = H2OConfig.build(**options)
    cls = AdaptiveHeadsKVCache if config.head_budget == "adaptive" else ArchiveKVCache if config.evicted_bits else H2OKVCache
    caches = per_layer_caches(model, lambda i: cls(config, seed=i))
    layers = [c for c in caches if isinstance(c, H2OKVCache)]
    if config.layer_budget == "pyramid":
        for c, m in zip(layers, layer_budgets(config, pyramid_weights(len(layers)))):
            c.config = layer_config(config, m)
    elif config.layer_budget == "dispersion":
        group = LayerBudgetGroup(config)
        for c in layers:
            c.budget_group, c.budget_index = group, group.add(c)
    return caches


register_policy(
    Policy(
        "h2o",
        "sink tokens + the most-attended heavy hitters + a recent window, per kv head, scored by the fused kernel",
        OPTIONS,
        _h2o_caches,
        (H2OKVCache, AdaptiveHeadsKVCache, ArchiveKVCache),
    )
)
