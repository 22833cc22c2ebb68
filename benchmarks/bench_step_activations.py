"""What two elementwise passes cost a decode step on the CPU: the SwiGLU activation of every MLP
(mlx-h2o's `swiglu` kernel against mlx-lm's `mx.compile`d `swiglu`), and the `logsumexp` over the
vocabulary that mlx-lm's `generate_step` takes of every step's logits (MLX's CPU logsumexp, scalar `exp`
on Linux). Steps alternate in one process on one model and cache, so the load drifts equally for all.

    python benchmarks/bench_step_activations.py [--context 512] [--steps 200] [--kv-dtype float16]

Variants, each a greedy step of the embedded model (full cache): "kernel" (the MLPs on the swiglu
kernel, logsumexp taken: what `generate_step` runs with `mlx_h2o.load()`), "mlx-lm swiglu" (the MLPs
switched back to mlx-lm's class), and "no logsumexp" (kernel MLPs, argmax of the raw logits).
Prints median and quartile step times; run it on a quiet machine (it records the load).
"""

import argparse
import os
import statistics
import time

import mlx_h2o  # isort: skip

mlx_h2o.use_openblas()  # before mlx.core loads: OpenBLAS for the prefill's matmuls

import mlx.core as mx

from mlx_h2o import cpu_layers
from mlx_h2o.evaluation.report import markdown_table

VARIANTS = ("kernel", "mlx-lm swiglu", "no logsumexp")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=200, help="steps per variant")
    ap.add_argument("--kv-dtype", default="float16", help="the full cache's row dtype ('model' for the model's)")
    args = ap.parse_args()
    model, tokenizer = mlx_h2o.load()
    mlps = [layer.mlp for layer in model.layers]
    if not all(isinstance(m, cpu_layers.KernelSwiGLU) for m in mlps):
        raise SystemExit("this model's MLPs are not on the swiglu kernel (not a SWIGLU_MLPS class, or not the CPU)")
    kernel_cls, stock_cls = type(mlps[0]), type(mlps[0]).__bases__[1]
    with open("/usr/share/common-licenses/GPL-3", encoding="utf-8") as f:
        ids = mx.array(tokenizer.encode(f.read() * 4)[: args.context])[None]
    options = {} if args.kv_dtype == "model" else {"kv_dtype": args.kv_dtype}
    cache = mlx_h2o.make_cache(model, "full", **options)
    for i in range(0, args.context - 1, 256):
        mx.eval(model(ids[:, i : min(i + 256, args.context - 1)], cache=cache))
    load = os.getloadavg()[0]
    y = ids[:, -1:]
    times = {v: [] for v in VARIANTS}
    for s in range(args.steps * len(VARIANTS)):
        variant = VARIANTS[s % len(VARIANTS)]
        for m in mlps:
            m.__class__ = stock_cls if variant == "mlx-lm swiglu" else kernel_cls
        t0 = time.perf_counter()
        logits = model(y, cache=cache)[:, -1]
        if variant != "no logsumexp":
            logits = logits - mx.logsumexp(logits, axis=-1, keepdims=True)  # generate_step's logprobs
        y = mx.argmax(logits, axis=-1, keepdims=True)
        mx.eval(y)
        times[variant].append((time.perf_counter() - t0) * 1e3)
    for m in mlps:
        m.__class__ = kernel_cls
    base = statistics.median(times["kernel"])
    rows = []
    for v, t in times.items():
        q1, q2, q3 = statistics.quantiles(t, n=4)
        rows.append([v, f"{q2:.2f}", f"{q1:.2f}-{q3:.2f}", f"{q2 - base:+.2f}"])
    print(f"context {args.context}, {args.steps} steps per variant, alternating; load {load:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after")
    print(markdown_table(["variant", "step p50 ms", "p25-p75 ms", "vs kernel ms"], rows))


if __name__ == "__main__":
    main()
