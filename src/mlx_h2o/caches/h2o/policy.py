"""The "h2o" policy: one h2o cache per layer, with the budget spread over layers as `layer_budget`
says (spread.py)."""

from ...distributed import model_group, tensor_group
from ...options import Policy
from .. import per_layer_caches, register_policy
from .cache import H2OKVCache
from .options import OPTIONS, H2OConfig
from .spread import LayerBudgetGroup, layer_budgets, pyramid_weights


class AdaptiveHeadsKVCache(H2OKVCache):
    """mlx-h2o 0.2.0's class for head_budget='adaptive' (now a part of H2OKVCache): named so that a
    prompt cache saved by 0.2.0 fails to load with a message naming that release."""


class ArchiveKVCache(H2OKVCache):
    """mlx-h2o 0.2.0's class for evicted_bits (now a part of H2OKVCache); see AdaptiveHeadsKVCache."""


def _h2o_caches(model, **options):
    """An h2o cache on every plain KVCache layer (sliding-window and other special layers keep the
    model's own cache); layer i's rotation is seeded with i."""
    config = H2OConfig.build(**options)
    group = tensor_group(model)
    caches = per_layer_caches(model, lambda i: H2OKVCache(config, seed=i, group=group))
    layers = [c for c in caches if isinstance(c, H2OKVCache)]
    for i, c in enumerate(layers):  # a byte budget per sequence is shared by the h2o layers (the others keep their own caches)
        c.layers = len(layers)
        # Compactions staggered over the layers: one decode step pays about one layer's, not all of
        # them every evict_every steps (~2x the median step before: docs/cpu-decode.md). Not under
        # dispersion, whose allocation all-reduces over the ranks at the first compaction: ranks
        # holding different layers (pipeline) would reach it at different steps.
        if config.budget.layer_budget != "dispersion":
            c.evict_phase = c.budget.evict_phase(i, len(layers)) if c.budget.resolved else i
    if config.budget.layer_budget == "pyramid":
        for c, m in zip(layers, layer_budgets(config.budget, pyramid_weights(len(layers)))):
            c.set_layer_budget(m)
    elif config.budget.layer_budget == "dispersion":
        budgets = LayerBudgetGroup(config.budget, model_group(model))
        for c in layers:
            c.budget_group, c.budget_index = budgets, budgets.add(c)
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
