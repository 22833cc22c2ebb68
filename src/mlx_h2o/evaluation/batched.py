"""Several cache policies decoded in one model call: each policy owns a block of the batch's rows.

On this CPU a decode step's cost is mostly reading the model's weights, which a batch reads once:
four policies x four samples in one batch of 16 rows cost far less than four batches of 4. The rows
of a batch never interact in a transformer, so every policy sees exactly what it would see alone
(tests/test_recall.py checks the NLLs against separate runs).

`policy_batch(model, caches_per_policy, rows)` -> one `PolicyBatch` per layer. Its `update_and_fetch`
hands each policy's rows to that policy's cache; `make_mask` asks every policy's cache (the model
builds the mask from layer 0's cache, as it would for each policy alone) and `attend` runs each
policy's attention on its rows exactly as the hook would (caches.base / hook.py).
"""

from typing import List, Sequence

import mlx.core as mx

from .. import hook
from ..caches.base import AttendingCache
from .memory import kv_bytes


class PerPolicyMasks(list):
    """The masks of the policies of a PolicyBatch, in policy order (what `make_mask` returns)."""


class PolicyBatch(AttendingCache):
    """One layer: the caches of several policies, policy i over batch rows [i * rows, (i + 1) * rows)."""

    def __init__(self, caches: Sequence, rows: int):
        self.caches = list(caches)
        self.rows = rows

    def _split(self, x: mx.array) -> List[mx.array]:
        if x.shape[0] != self.rows * len(self.caches):
            raise ValueError(f"batch of {x.shape[0]} rows for {len(self.caches)} policies x {self.rows} rows")
        return [x[i * self.rows : (i + 1) * self.rows] for i in range(len(self.caches))]

    @property
    def offset(self):
        return self.caches[0].offset

    def update_and_fetch(self, keys, values):
        return [c.update_and_fetch(k, v) for c, k, v in zip(self.caches, self._split(keys), self._split(values))], None

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        from mlx_lm.models.base import create_attention_mask

        probe = mx.zeros((1, N, 1))
        return PerPolicyMasks(create_attention_mask(probe, c, window_size=window_size, return_array=return_array) for c in self.caches)

    def attend(self, queries, keys, values, *, scale, mask=None, sinks=None):
        masks = mask if isinstance(mask, PerPolicyMasks) else [mask] * len(self.caches)
        outs = [
            hook._dispatch(q, kv[0], kv[1], c, scale, m, sinks)
            for c, q, kv, m in zip(self.caches, self._split(queries), keys, masks)
        ]
        return mx.concatenate(outs, axis=0)

    def _payload(self):
        raise NotImplementedError("a PolicyBatch is a measurement device: save each policy's caches instead")

    @property
    def nbytes(self):
        return sum(c.nbytes for c in self.caches)


def policy_batch(per_policy_caches: Sequence[Sequence], rows: int) -> List[PolicyBatch]:
    """Per layer, one PolicyBatch over the policies' caches of that layer (each a make_cache list)."""
    layers = {len(c) for c in per_policy_caches}
    if len(layers) != 1:
        raise ValueError("every policy's cache list must have one cache per layer of the same model")
    return [PolicyBatch([c[i] for c in per_policy_caches], rows) for i in range(layers.pop())]


def policy_kv_bytes(batch: Sequence[PolicyBatch], policy: int) -> int:
    """The KV bytes policy number `policy` holds over all layers (see memory.kv_bytes)."""
    return kv_bytes([layer.caches[policy] for layer in batch])
