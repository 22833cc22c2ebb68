"""Decode-step time against the number of rows in the batch (batched serving, policies decoded
together), for each weight format of the embedded model.

    python benchmarks/bench_batch_rows.py [--rows 1 4 8 9 12 16 32] [--weights quantized float32] [--steps 7]
        [--kernel-max-rows 8 100000]

The packed weights run mlx-h2o's integer-dot kernel for up to KERNEL_MAX_ROWS rows (cpu_layers.py) and
dequantize every weight into a BLAS GEMM above it; this shows where that switch costs. Per rows and
format: a full cache prefilled with 16 tokens, then --steps one-token steps; the median and the spread
(min-max) in ms, and ms per row. With several --kernel-max-rows (packed weights), the settings
alternate step by step on the same cache, so each row of the table compares them on the same noise. The load average is printed before and after: on a shared machine
the BLAS and kernel thread pools collapse, and the table says nothing.
"""

import argparse
import os
import time

import mlx_h2o  # isort: skip

mlx_h2o.use_openblas()  # as the CLI: OpenBLAS matmuls, before mlx.core loads

import mlx.core as mx
import numpy as np

from mlx_h2o import cpu_layers


def step_times(model, rows: int, steps: int, limits) -> dict:
    """{kernel max rows: step times in ms}, the limits alternating step by step (None: as set)."""
    cache = mlx_h2o.make_cache(model, "full")
    mx.eval(model(mx.zeros((rows, 16), dtype=mx.int32), cache=cache))
    times = {limit: [] for limit in limits}
    for _ in range(steps):
        for limit in limits:
            if limit is not None:
                cpu_layers.KERNEL_MAX_ROWS = limit
            t = time.perf_counter()
            mx.eval(model(mx.zeros((rows, 1), dtype=mx.int32), cache=cache))
            times[limit].append(time.perf_counter() - t)
            for c in cache:  # the same context for every setting and step
                c.trim(1)
    return {limit: np.array(t) * 1e3 for limit, t in times.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", nargs="+", type=int, default=[1, 4, 8, 9, 12, 16, 32])
    p.add_argument("--weights", nargs="+", default=["quantized", "float32"])
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--kernel-max-rows", nargs="+", type=int, default=None,
                   help="KERNEL_MAX_ROWS settings to alternate (packed weights; default: as set)")
    args = p.parse_args(argv)
    if any(r < 1 for r in args.rows) or args.steps < 1:
        p.error("--rows and --steps must be >= 1")
    if args.kernel_max_rows and any(r < 0 for r in args.kernel_max_rows):
        p.error("--kernel-max-rows must be >= 0")
    limits = args.kernel_max_rows or [None]
    print(f"load before: {os.getloadavg()[0]:.2f}")
    print("| weights | kernel max rows | rows | ms per step (median) | min-max | ms per row |")
    print("|---|---|---|---|---|---|")
    for weights in args.weights:
        model, _ = mlx_h2o.load(weights=weights)
        for rows in args.rows:
            for limit, ms in step_times(model, rows, args.steps, limits).items():
                shown = cpu_layers.KERNEL_MAX_ROWS if limit is None else limit
                print(f"| {weights} | {shown} | {rows} | {np.median(ms):.1f} | {ms.min():.1f}-{ms.max():.1f} | "
                      f"{np.median(ms) / rows:.2f} |", flush=True)
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
