"""Bounded caches on MLX's distributed engine: `mlx.launch`, `mx.distributed`, mlx-lm's sharded models.

Tensor parallel (`shard`, mlx-lm's `model.shard(group)`): every rank holds 1/N of each layer's query
and kv heads, so its caches are sized from the post-shard head count and hold 1/N of the KV. An h2o
cache evicting per kv head needs no communication; where one set of entries is shared by the heads
(`select='layer'`, head_budget='adaptive', layer_budget='dispersion') the cache all-reduces what the
choice reads over the group (caches/h2o/eviction.py, spread.py), so every rank keeps the positions a
single rank would.

Pipeline parallel (`pipeline`): ranks own contiguous layer ranges, rank 0 the last (mlx-lm's
convention); a rank's caches of other ranks' layers stay empty. Models with mlx-lm's
`PipelineMixin` use their own `model.model.pipeline`; any other model whose blocks run in order
(`model.layers`) is staged here with no model edits: each block's class becomes a subclass that
receives the hidden state before its rank's first layer, sends it after the last, and gathers the
output at the model's last layer.

Caches saved on a rank record the group (rank, size) and load only on that rank of a group of that
size: a rank's file holds its own heads.
"""

import copy
from dataclasses import dataclass, field
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import AllToShardedLinear, QuantizedAllToShardedLinear

_SHARDED = (AllToShardedLinear, QuantizedAllToShardedLinear)


def tensor_group(model: nn.Module) -> Optional[mx.distributed.Group]:
    """The group a model's layers are tensor-sharded over (mlx-lm's `shard`), or None (one rank)."""
    for _, module in model.named_modules():
        if isinstance(module, _SHARDED) and module.group.size() > 1:
            return module.group
    return None


def pipeline_group(model: nn.Module) -> Optional[mx.distributed.Group]:
    """The group a model's layers are pipelined over (`pipeline`, or mlx-lm's PipelineMixin), or None."""
    for layer in _blocks(model):
        stage = getattr(layer, "_pipeline_stage", None)
        if stage is not None:
            return stage.group
    inner = getattr(model, "model", None)
    if getattr(inner, "pipeline_size", 1) > 1:
        return mx.distributed.init()  # mlx-lm's PipelineMixin keeps no group: its loaders pass the world's
    return None


def model_group(model: nn.Module) -> Optional[mx.distributed.Group]:
    """The group over which a model is spread (tensor or pipeline parallel), or None."""
    return tensor_group(model) or pipeline_group(model)


def _attention_heads(model):
    for _, module in model.named_modules():
        heads = getattr(module, "n_heads", None), getattr(module, "n_kv_heads", None)
        if all(isinstance(h, int) for h in heads):
            yield module, heads


def shard(model: nn.Module, group: Optional[mx.distributed.Group] = None) -> nn.Module:
    """Tensor-parallel `model` over `group` (default: the world) with mlx-lm's own `model.shard`, in
    place, after checking that every attention's heads divide; layers that ran mlx-h2o's CPU kernels
    keep them (the sharded layers take the same kernels). Returns the model."""
    group = group or mx.distributed.init()
    N = group.size()
    if not hasattr(model, "shard"):
        raise ValueError(f"{type(model).__module__}.Model has no shard(): mlx-lm cannot run it tensor parallel; use pipeline()")
    for module, (heads, kv_heads) in _attention_heads(model):
        if heads % N or kv_heads % N:
            raise ValueError(f"tensor parallel over {N} ranks needs the query and kv heads to divide by {N}: "
                             f"{type(module).__name__} has {heads} query and {kv_heads} kv heads "
                             f"(use a group size that divides {kv_heads}, or pipeline())")
    from .cpu_layers import KERNEL_CLASSES, use_cpu_layer_kernels

    layer_kernels = any(type(m) in KERNEL_CLASSES.values() for _, m in model.named_modules())
    model.shard(group)
    if layer_kernels:
        use_cpu_layer_kernels(model)  # shard_linear made stock sharded layers (the MLPs keep their class)
    return model


@dataclass(frozen=True)
class PipelineStage:
    """What one layer slot does on this rank (`pipeline`)."""

    group: mx.distributed.Group
    runs: bool  # this rank owns the layer
    receive_from: Optional[int]  # rank whose hidden state arrives before this layer
    send_to: Optional[int]  # rank the hidden state goes to after this layer
    gathers: bool  # the model's last layer: every rank takes rank 0's output
    # The hidden state's dtype on the wire, told by the sender on the first call: the receiver holds only
    # the embedding's output (float16 for a GGUF) while the sender's layers may have promoted it.
    wire: dict = field(default_factory=dict, compare=False)

    def receive(self, h: mx.array) -> mx.array:
        if "dtype" not in self.wire:
            code = mx.distributed.recv((), mx.int32, self.receive_from, group=self.group).item()
            self.wire["dtype"] = WIRE_DTYPES[code]
        return mx.distributed.recv(h.shape, self.wire["dtype"], self.receive_from, group=self.group)

    def send(self, h: mx.array) -> mx.array:
        if "dtype" not in self.wire:
            if h.dtype not in WIRE_DTYPES:
                raise ValueError(f"pipeline: cannot pass a hidden state of dtype {h.dtype} between ranks")
            mx.eval(mx.distributed.send(mx.array(WIRE_DTYPES.index(h.dtype), mx.int32), self.send_to, group=self.group))
            self.wire["dtype"] = h.dtype
        return mx.distributed.send(h, self.send_to, group=self.group)


WIRE_DTYPES = [mx.float32, mx.float16, mx.bfloat16]
_STAGED_CLASSES = {}


def _staged_class(cls):
    """`cls` with its call wrapped by its pipeline stage (cached: one subclass per block class)."""
    if cls not in _STAGED_CLASSES:

        def __call__(self, h, *args, **kwargs):
            stage = self._pipeline_stage
            if stage.receive_from is not None:
                h = stage.receive(h)
            if stage.runs:
                h = cls.__call__(self, h, *args, **kwargs)
            if stage.send_to is not None:
                h = stage.send(h)
            if stage.gathers:
                h = mx.distributed.all_gather(h, group=stage.group)[: h.shape[0]]
            return h

        _STAGED_CLASSES[cls] = type(f"Pipelined{cls.__name__}", (cls,), {"__call__": __call__})
    return _STAGED_CLASSES[cls]


def _blocks(model) -> list:
    layers = getattr(model, "layers", None)
    return list(layers) if isinstance(layers, list) else []


def pipeline_split(n_layers: int, size: int):
    """Layers per rank: even, the low ranks taking the extra ones (mlx-lm's PipelineMixin)."""
    base, extra = divmod(n_layers, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


def pipeline(model: nn.Module, group: Optional[mx.distributed.Group] = None) -> nn.Module:
    """Pipeline-parallel `model` over `group` (default: the world), in place: rank r runs the layers
    after those of ranks r+1 ... size-1 (rank 0 the last ones) and drops the other layers' weights.
    Returns the model."""
    group = group or mx.distributed.init()
    inner = getattr(model, "model", None)
    if hasattr(inner, "pipeline"):
        inner.pipeline(group)
        return model
    blocks = _blocks(model)
    rank, size = group.rank(), group.size()
    if len(blocks) < size:
        raise ValueError(f"pipeline over {size} ranks needs at least {size} layers; the model has {len(blocks)}")
    if any(hasattr(b, "_pipeline_stage") for b in blocks):
        raise ValueError("the model is already pipelined")
    split = pipeline_split(len(blocks), size)
    start = sum(split[rank + 1 :])
    end = start + split[rank]
    for i, block in enumerate(blocks):
        stage = PipelineStage(group, start <= i < end, rank + 1 if i == start and rank < size - 1 else None,
                              rank - 1 if i == end - 1 and rank > 0 else None, i == len(blocks) - 1 and size > 1)
        if not stage.runs:
            for key in list(block.keys()):  # another rank's weights: freed (attributes such as use_sliding stay)
                del block[key]
        block.__class__ = _staged_class(type(block))
        object.__setattr__(block, "_pipeline_stage", stage)
    return model


class SharesGroup:
    """Deep copies share the `group` attribute: an mx.distributed.Group cannot be copied, and a copy of
    a cache (mlx-lm's server copies one per request) lives on the same ranks."""

    def __deepcopy__(self, memo):
        out = copy.copy(self)
        memo[id(self)] = out
        for key, value in vars(self).items():
            if key != "group":
                setattr(out, key, copy.deepcopy(value, memo))
        return out


def all_sum(x: mx.array, group: Optional[mx.distributed.Group]) -> mx.array:
    """x summed over `group` (x itself without one)."""
    return x if group is None else mx.distributed.all_sum(x, group=group)


def process_ranks() -> Optional[list]:
    """[rank, size] of this process when it is one of several (mlx.launch), else None."""
    group = mx.distributed.init()
    return [group.rank(), group.size()] if group.size() > 1 else None


def check_saved_ranks(saved, what: str) -> None:
    """A cache saved by rank r of N (`saved` = [r, N], None for one process) holds that rank's heads or
    layers: it loads only on rank r of N, never silently into another rank's model."""
    here = process_ranks()
    if (list(saved) if saved else None) != here:
        def name(ranks):
            return "one process" if ranks is None else f"rank {ranks[0]} of {ranks[1]}"

        raise ValueError(f"{what} was saved by {name(saved)}; this process is {name(here)} "
                         f"(load each rank's file on that rank, with the same number of ranks)")
