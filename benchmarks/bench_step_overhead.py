"""Where a decode step's time goes: Python graph building, the linear layers (matmuls), attention,
and everything else MLX evaluates (norms, RoPE, residual adds, cache writes, sampling, op dispatch).

    python benchmarks/bench_step_overhead.py [--context 512] [--steps 30] [--modes quantized quantized:stock float32:stock]
        [--caches full full:kv_dtype=float16]

A mode is a weight format of the embedded model (quantized, float32, ...), with ":stock" for MLX's own
layers (mlx_h2o.load(cpu_kernels=False): MLX's quantized_matmul, rms_norm and rope fallbacks)
instead of the extension's kernels. For each mode and each of --caches (policy specs, default the full
cache): prefill --context tokens into the cache (fused attention on), then run
greedy decode steps in four variants, alternating step by step on the same model and cache: as is;
with every linear layer (incl. the lm_head) replaced by a zeros array of its output shape; with the
attention replaced likewise; with both. The differences are each part's in-place cost (kernel + its
dispatch); what is left with both replaced is the per-token overhead, split into graph building
(Python) and evaluation. An h2o cache has no step without its attention (its scores), so for it only
the step as is is timed, split into building and evaluation. Also counts one step's primitives by
kind. `uptime` is printed with the table: timings on a shared machine are provisional.
"""

import argparse
import os
import time

import mlx_h2o  # isort: skip

mlx_h2o.use_openblas()  # this benchmark opts in: OpenBLAS matmuls, before mlx.core loads

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_h2o import cpu_layers, hook
from mlx_h2o.caches.h2o import H2OKVCache
from mlx_h2o.evaluation import load_corpus, token_samples
from mlx_h2o.evaluation.report import markdown_table
from mlx_h2o.evaluation.speed import graph_primitives
from mlx_h2o.evaluation.runner import parse_specs

# Every class whose own method computes a linear layer: MLX's, and the kernel subclasses that override it.
LINEARS = [(nn.Linear, "__call__"), (nn.QuantizedLinear, "__call__"), (nn.Embedding, "as_linear"),
           (nn.QuantizedEmbedding, "as_linear"), (cpu_layers.KernelQuantizedLinear, "__call__"),
           (cpu_layers.KernelQuantizedEmbedding, "as_linear")]


def _zeros_linear(self, x):
    return mx.zeros((*x.shape[:-1], self["weight"].shape[0]), x.dtype)


def _zeros_attention(q, k, v, **kw):
    return mx.zeros((*q.shape[:-1], v.shape[-1]), q.dtype), None


class _ZeroProducts:
    """cpu_layers' `_ext` with every quantized product a zeros array of its output's shape (or, where
    the product adds a residual, the residual): the packed q/k/v and gate/up products and the fused
    ones (norm, swiglu, residual inside) call the extension directly, not a layer."""

    def __init__(self, ext):
        self._ext = ext

    def __getattr__(self, name):
        return getattr(self._ext, name)

    def quantized_matmul(self, x, w, *args, **kwargs):
        residual = args[7] if len(args) > 7 else kwargs.get("residual")  # (scales, biases, group_size, bits, max_rows, norm_weight, norm_eps, residual, ...)
        return residual if residual is not None else mx.zeros((*x.shape[:-1], w.shape[0]), x.dtype)


class Replaced:
    """Within the block, linear layers and/or attention return zeros of their output's shape."""

    def __init__(self, linears, attention):
        self.linears, self.attention = linears, attention

    def __enter__(self):
        self.saved = [(c, m, c.__dict__[m]) for c, m in LINEARS] + [(hook, "scaled_dot_product_attention_with_scores",
                                                                        hook.scaled_dot_product_attention_with_scores),
                                                                       (cpu_layers, "_packed_matmul", cpu_layers._packed_matmul),
                                                                       (cpu_layers, "_ext", cpu_layers._ext)]
        if self.linears:
            for c, m in LINEARS:
                setattr(c, m, _zeros_linear)
            cpu_layers._packed_matmul = _zeros_linear  # what the flat llama blocks call in place of the layers
            cpu_layers._ext = _ZeroProducts(cpu_layers._ext)
        if self.attention:
            hook.scaled_dot_product_attention_with_scores = _zeros_attention

    def __exit__(self, *exc):
        for obj, name, value in self.saved:
            setattr(obj, name, value)


VARIANTS = {"as is": (False, False), "no linears": (True, False), "no attention": (False, True), "neither": (True, True)}


def written_rows(cache):
    """What evaluates a cache's writes of the step: mlx-lm's dense caches' K and V buffers (their
    `state` would slice them, ops of their own), or the state."""
    rows = [getattr(cache, "keys", None), getattr(cache, "values", None)]
    return rows if all(isinstance(a, mx.array) for a in rows) else cache.state


def primitive_counts(model, cache, y):
    """Primitives in one decode step's graph, by kind (from MLX's DOT export)."""
    out = mx.argmax(model(y, cache=cache)[:, -1], axis=-1)
    counts = graph_primitives(out)
    mx.eval(out, [c.state for c in cache])
    return counts


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--modes", nargs="+", default=["quantized", "quantized:stock", "float32:stock"])
    ap.add_argument("--caches", nargs="+", default=["full"], metavar="SPEC", help="policy specs, e.g. full:kv_dtype=float16")
    args = ap.parse_args()
    try:
        caches = parse_specs(args.caches)
    except ValueError as e:
        ap.error(f"--caches: {e}")
    mlx_h2o.use_fast_cpu_attention(True)
    runs = {}
    tokens = None
    for mode in args.modes:
        weights, _, layers = mode.partition(":")
        if layers not in ("", "stock"):
            ap.error(f"mode {mode!r}: the layers after ':' are 'stock' or nothing")
        model, tokenizer = mlx_h2o.load(weights=weights, cpu_kernels=layers != "stock")
        if tokens is None:
            tokens = token_samples(tokenizer, load_corpus(), 1, args.context, seed=1)[0][1]
        for spec in caches:
            cache = mlx_h2o.make_cache(model, spec.policy, **spec.options)
            for i in range(0, len(tokens), 512):
                mx.eval(model(mx.array(tokens[i : i + 512])[None], cache=cache))
            y = mx.array(tokens[-1:])[None]
            name = mode if len(caches) == 1 else f"{mode}, {spec.label}"
            # A cache that ranks entries by the attention they get (h2o) has no step without attention:
            # the zeroed variants would leave it scoreless (a sliding window from then on) and add
            # their tokens to its rows. Only its step as is is timed.
            scores = any(isinstance(c, H2OKVCache) for c in cache)
            runs[name] = dict(model=model, cache=cache, y=y, times={v: ([], []) for v in VARIANTS}, kernels=layers != "stock",
                              scores=scores)
    for step in range(args.steps + 2):
        for mode, r in runs.items():
            for variant, (no_linears, no_attention) in VARIANTS.items():
                if variant != "as is" and r["scores"]:
                    continue
                with Replaced(no_linears, no_attention):
                    t0 = time.perf_counter()
                    out = mx.argmax(r["model"](r["y"], cache=r["cache"])[:, -1], axis=-1)
                    t1 = time.perf_counter()
                    # replaced attention leaves the writes unread (the real one reads the rows it writes)
                    mx.eval(out, [written_rows(c) for c in r["cache"]] if no_attention else [])
                    t2 = time.perf_counter()
                if variant == "as is":
                    r["y"] = out[None]
                if step >= 2:
                    r["times"][variant][0].append(t1 - t0)
                    r["times"][variant][1].append(t2 - t1)
    rows = []
    for mode, r in runs.items():
        ms = {v: (np.median(b) * 1e3, np.median(e) * 1e3) for v, (b, e) in r["times"].items() if b}
        total = sum(ms["as is"])
        counts = primitive_counts(r["model"], r["cache"], r["y"])
        top = ", ".join(f"{k} {n}" for k, n in counts.most_common(8))
        if r["scores"]:  # the step as is only (above): its graph building, and the rest
            build, other = ms["as is"]
            parts = ["-", "-", f"{build:.1f} (all)", f"{other:.1f} (all evaluation)", "-"]
        else:
            linears = total - sum(ms["no linears"])
            attention = total - sum(ms["no attention"])
            build, other = ms["neither"]
            parts = [f"{linears:.1f}", f"{attention:.1f}", f"{build:.1f}", f"{other:.1f}", f"{100 * (build + other) / total:.0f}%"]
        rows.append([mode, f"{total:.1f}", f"{1e3 / total:.1f}", *parts, f"{sum(counts.values())} ({top})"])
    print(f"context {args.context}, {args.steps} steps per variant; uptime: {os.popen('uptime').read().strip()}")
    print(markdown_table(["mode", "step ms", "tok/s", "linears ms", "attention ms", "python build ms",
                          "other eval ms", "overhead share", "primitives per step (most common)"], rows))


if __name__ == "__main__":
    main()
