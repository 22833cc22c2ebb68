"""The protocol of mlx-h2o's caches, on top of mlx-lm's `_BaseCache`.

`SavedCache`: one versioned save format for every mlx-h2o cache. `state` is `(payload, meta_state)`:
the payload a tree of arrays (and None / numbers) mlx-lm's `save_prompt_cache` can write, the
meta_state a JSON string naming the format version and holding the cache's configuration.
`load_prompt_cache` passes `state` back to `from_state`; a file in another format fails with a
message naming the mlx-h2o release that wrote it. mlx-lm 0.32 saves `state` only; releases that also
save `meta_state` assign it after `state` in `from_state` - it repeats what `state` carried, so the
setter only checks it. A subclass gives `_payload()`, `_meta()` and `_restore(payload, meta)`.

`AttendingCache`: a cache that computes its layer's attention. mlx-lm models call
`mlx_lm.models.base.scaled_dot_product_attention(queries, keys, values, cache, ...)` with what the
cache's `update_and_fetch` returned; the hook (hook.py) hands that call to the cache's `attend`.
Making an instance in any way - the constructor, `from_state` (load_prompt_cache), `copy` - installs
the hook, so no policy can forget it and a cache loaded in a fresh process attends like a made one.

`LayerByLayerPrefill`: what every cache that attends (both of the above) does with a multi-token call.
"""

import functools
import json
from typing import Optional

import mlx.core as mx
from mlx_lm.models import cache as lm_cache

from .. import hook
from ..distributed import check_saved_ranks, process_ranks

SAVE_FORMAT = 2  # mlx-h2o 0.1.0 wrote format 1 (unversioned states); a class may move on (save_format)
FORMAT_KEY = "mlx_h2o_save_format"
RANKS_KEY = "ranks"  # [rank, size] of the process that saved the cache, when it was one of several
# Save format -> the mlx-h2o release that first wrote it, for error messages (format 3: the h2o cache
# of parts, whose rows carry their bookkeeping as columns).
FORMAT_RELEASES = {1: "0.1.0", 2: "0.2.0", 3: "0.3.0"}


def _release(fmt) -> str:
    return f"mlx-h2o {FORMAT_RELEASES.get(fmt, 'newer than this one')} (save format {fmt})"


def parse_meta(cls, meta) -> dict:
    """The meta_state dict of a saved cache of class `cls`, or a ValueError saying which release
    wrote the file."""
    try:
        d = json.loads(meta) if isinstance(meta, str) else None
    except json.JSONDecodeError:
        d = None
    fmt = d.get(FORMAT_KEY, 1) if isinstance(d, dict) else 1
    if fmt != cls.save_format:
        from .. import __version__

        raise ValueError(
            f"this {cls.__name__} prompt cache was saved by {_release(fmt)}; mlx-h2o {__version__} reads save format "
            f"{cls.save_format} only: recompute the prompt cache (e.g. mlx_lm.cache_prompt) with this release"
        )
    return d


class SavedCache(lm_cache._BaseCache):
    """The versioned save format (see the module docstring)."""

    save_format = SAVE_FORMAT

    def _payload(self):
        raise NotImplementedError

    def _meta(self) -> dict:
        raise NotImplementedError

    def _restore(self, payload, meta: dict) -> None:
        raise NotImplementedError

    @property
    def meta_state(self) -> str:
        ranks = process_ranks()  # a rank's cache holds its heads or layers only (distributed.py)
        return json.dumps({FORMAT_KEY: self.save_format, **self._meta(), **({RANKS_KEY: ranks} if ranks else {})})

    @meta_state.setter
    def meta_state(self, value) -> None:
        parse_meta(type(self), value)  # the state, set first, already restored the cache

    @property
    def state(self):
        return self._payload(), self.meta_state

    @state.setter
    def state(self, value):
        paired = isinstance(value, (tuple, list)) and len(value) == 2  # 0.1.0 states were flat tuples or dicts
        meta = parse_meta(type(self), value[1] if paired else None)
        check_saved_ranks(meta.get(RANKS_KEY), f"this {type(self).__name__}")
        self._restore(value[0], meta)

    @classmethod
    def from_state(cls, state, meta_state=None):
        obj = cls.__new__(cls)
        obj.state = state
        if meta_state is not None:
            obj.meta_state = meta_state
        return obj


# Queries per call from which a layer's attention output is evaluated as soon as it is built (below).
PREFILL_EVAL_ROWS = 64


def evaluated_when_prefilling(attend):
    """`attend` that evaluates its output at once when the call brings PREFILL_EVAL_ROWS queries or more."""

    @functools.wraps(attend)
    def attend_and_evaluate(self, queries, *args, **kwargs):
        out = attend(self, queries, *args, **kwargs)
        if queries.ndim == 4 and queries.shape[2] >= PREFILL_EVAL_ROWS:
            try:
                mx.eval(out)
            except ValueError as e:  # inside mx.compile or mx.vmap, which cannot evaluate: the chunk stays lazy
                if "function transformations" not in str(e):
                    raise
        return out

    return attend_and_evaluate


class LayerByLayerPrefill:
    """Mixin: every `attend` of the class and its subclasses evaluates a prefill chunk's output layer by
    layer. mlx-lm's generate_step builds a whole chunk's graph and evaluates it at once, and MLX then
    holds several layers' temporaries together: +79 MiB at 511 tokens on the embedded model, against
    +57 evaluated layer by layer, K/V included (benchmarks/trace_prefill_memory.py); that set the
    process's peak RSS. Evaluated where each layer's attention ends, the graph left to the next
    evaluation is one layer deep. The values are the same; gradients flow through (mx.grad allows
    an evaluation inside); under mx.compile or mx.vmap, which do not, the chunk stays lazy. Decode
    steps (one query) stay lazy, and so async."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "attend" in cls.__dict__:
            cls.attend = evaluated_when_prefilling(cls.attend)


class AttendingCache(LayerByLayerPrefill, SavedCache):
    """A cache that owns its attention (see the module docstring)."""

    def __new__(cls, *args, **kwargs):
        hook.install()  # every way of making an instance passes here
        return super().__new__(cls)

    def attend(self, queries, keys, values, *, scale, mask=None, sinks=None):
        """This layer's attention output (B, Hq, L, Dv) for `queries` over what `update_and_fetch`
        returned (`keys`, `values`: arrays, or K/V segments and None)."""
        raise NotImplementedError


def fetched_ids(fetched) -> tuple:
    """What `handed_on` compares a layer's attention call with: the ids of the (keys, values) a
    cache's update_and_fetch returned (ids only: references would keep the buffers)."""
    return id(fetched[0]), id(fetched[1])


def handed_on(ids: Optional[tuple], keys, values) -> bool:
    """Whether attention got exactly what update_and_fetch returned (`ids`): the model hands the
    rows on untouched (mlx-lm's attention), so they may come as segments of the fused op. Models
    that read them don't: MLA computes with its latents and passes them on as keys and values both,
    gemma2 attends inline and never calls."""
    return ids == (id(keys), id(values))


class FusedAttention(LayerByLayerPrefill):
    """Mixin for an mlx-lm cache: its layer's attention by the fused kernel on CPU streams
    (`hook.fused_attention`), mlx-lm's own elsewhere or after `use_fast_cpu_attention(False)`."""

    def __new__(cls, *args, **kwargs):
        hook.install()  # the constructor, from_state (load_prompt_cache) and copies all pass here
        return super().__new__(cls)

    def attend(self, queries, keys, values, *, scale, mask=None, sinks=None):
        if not hook.baseline_attention_fused():
            return hook.mlx_lm_attention(queries, keys, values, self, scale, mask, sinks)
        return hook.fused_attention(queries, keys, values, self, scale, mask, sinks)  # mlx-lm's off the CPU
