"""Decode speed at a given context length: tokens/s and the per-step latency distribution; the
primitives a step's graph holds (each costs a decode step ~8 µs on 2 cores, docs/cpu-decode.md)."""

import collections
import os
import re
import tempfile
import time
from typing import Optional

import mlx.core as mx
import numpy as np

from .memory import kv_bytes, memory_snapshot


def graph_primitives(*outputs: mx.array) -> collections.Counter:
    """The primitives of the graph that computes `outputs` (not evaluated yet), by kind: the
    rectangles of MLX's DOT export."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "graph.dot")
        mx.export_to_dot(path, *outputs)
        with open(path, encoding="utf-8") as f:
            return collections.Counter(re.findall(r'label ="([^"]+)", shape=rectangle', f.read()))


def decode_step_times(model, cache, y: mx.array, steps: int) -> list:
    """Seconds of each of `steps` greedy decode steps from token(s) y (B, 1): one model call plus
    the sampling, evaluated before the clock stops, as mlx_lm.generate does."""
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        y = mx.argmax(model(y, cache=cache)[:, -1:], axis=-1)
        mx.eval(y)
        times.append(time.perf_counter() - t)
    return times


def decode_benchmark(model, cache, context_tokens, steps: int = 64, prefill_chunk: int = 512, progress=None) -> dict:
    """Prefill `context_tokens` (1-D) through `cache` in chunks, then time `steps` greedy decode steps.

    Returns tok/s, p50/p99/max step latency (ms), memory and KV bytes.
    """
    ctx = mx.array(np.asarray(context_tokens))[None]
    if ctx.shape[1] < 1:
        raise ValueError("context_tokens must hold at least one token")
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    for i in range(0, ctx.shape[1] - 1, prefill_chunk):
        mx.eval(model(ctx[:, i : min(i + prefill_chunk, ctx.shape[1] - 1)], cache=cache))
        mx.eval([c.state for c in cache])
        if progress:
            progress(min(prefill_chunk, ctx.shape[1] - 1 - i))
    prefill_s = time.perf_counter() - t0
    ms = np.array(decode_step_times(model, cache, ctx[:, -1:], steps)) * 1e3
    return {
        "context": int(ctx.shape[1]),
        "steps": steps,
        "prefill_tok_s": (ctx.shape[1] - 1) / prefill_s if prefill_s > 0 else float("nan"),
        "decode_tok_s": steps / (ms.sum() / 1e3),
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "max_ms": float(ms.max()),
        "kv_bytes": kv_bytes(cache),
        **memory_snapshot(),
    }
