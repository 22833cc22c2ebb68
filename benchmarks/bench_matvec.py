"""The integer-dot quantized matmul alone, on the embedded model's own weights: time per product,
weight bytes read per second and multiply-accumulates per second, for each thread count.

    python benchmarks/bench_matvec.py [--layer gate_proj ... | all | step] [--rows 1 4] [--threads 1 2] [--repeats 30]
                                      [--isa best avx2]

Each repeat evaluates one product per transformer layer (30 of them, back to back in one mx.eval, as
a decode step runs them) with a fresh random x; the median per product is printed with the spread.
`lm_head` is the tied output layer (the 8-bit embedding as a linear), one product a step. With
`--layer all`, each thread count's rows end with the sum a decode step runs (every layer's products
and the lm_head, medians). Products that fit the last-level cache stay there between repeats: a
step streams ~100 MB of weights from memory, so this is the kernels' own cost, not the step's.
`--layer step` runs that: all of a decode step's products (7 per layer and the lm_head, 211) in one
mx.eval, ~100 MB of weights from memory, the per-product figure being the step's time over 211.
Thread counts and kernel variants (`--isa`: `best`, the one this CPU runs, or an older one forced with
MLX_H2O_KERNEL_ISA) run in fresh processes (both are read once per process), alternating.
Where a decode step's linears stand against the machine's memory bandwidth: docs/cpu-decode.md.
"""

import argparse
import json
import os
import subprocess
import sys
import time

from bench_peer import ISA_OPTIONS, with_kernel_variant

LAYERS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
STEP = "step"  # every product of a decode step in one evaluation


def worker(layer: str, rows: int, repeats: int) -> dict:
    import mlx_h2o
    import mlx.core as mx
    import numpy as np

    from mlx_h2o import _ext

    model, _ = mlx_h2o.load()
    head = getattr(model, "lm_head", None) or model.model.embed_tokens
    if layer == "lm_head":
        mods = [head]
    elif layer == STEP:
        mods = [getattr(blk.self_attn if name in LAYERS[:4] else blk.mlp, name) for blk in model.layers
                for name in LAYERS[:-1]] + [head]
    else:
        mods = [getattr(blk.self_attn if layer in LAYERS[:4] else blk.mlp, layer) for blk in model.layers]
    shapes = [(m["weight"].shape[1] * 32 // m.bits, m["weight"].shape[0]) for m in mods]  # (K, N) each
    times = []
    for _ in range(repeats + 3):
        xs = [mx.random.normal((1, rows, k)) for k, _ in shapes]
        mx.eval(xs)
        outs = [_ext.quantized_matmul(x, m["weight"], m["scales"], m["biases"], m.group_size, m.bits, rows, None)
                for x, m in zip(xs, mods)]
        t0 = time.perf_counter()
        mx.eval(outs)
        times.append((time.perf_counter() - t0) / len(mods))
    t = np.array(times[3:])
    nbytes = sum(m[a].nbytes for m in mods for a in ("weight", "scales", "biases")) / len(mods)
    k, n = shapes[0]
    macs = rows * sum(k * n for k, n in shapes) / len(mods)
    return dict(isa=_ext.kernel_isa(), per_step=len(mods),
                shape="every product" if layer == STEP else f"{k}x{n}",
                bits="4/8" if layer == STEP else mods[0].bits, group=mods[0].group_size,
                median_us=float(np.median(t) * 1e6), min_us=float(t.min() * 1e6), max_us=float(t.max() * 1e6),
                gb_s=float(nbytes / np.median(t) / 1e9), gmac_s=float(macs / np.median(t) / 1e9))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layer", nargs="+", default=["gate_proj"], choices=LAYERS + ("all", STEP))
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--isa", nargs="+", default=["best"], choices=("best",) + ISA_OPTIONS,
                    help="kernel variants to alternate (MLX_H2O_KERNEL_ISA; best: the one this CPU runs)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if min(args.rows) < 1 or min(args.threads) < 1 or args.repeats < 1 or args.rounds < 1:
        ap.error("--rows, --threads, --repeats and --rounds must be >= 1")
    if args.worker:
        print(json.dumps(worker(args.layer[0], args.rows[0], args.repeats)))
        return
    layers = LAYERS if "all" in args.layer else args.layer
    print(f"load before: {os.getloadavg()[0]:.2f}")
    print("| layer | shape | rows | threads | kernel | round | µs per product (median) | min-max | weight GB/s | GMAC/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    runs = [(threads, isa) for threads in args.threads for isa in args.isa]
    for rows in args.rows:
        for rnd in range(args.rounds):
            for threads, isa in runs if rnd % 2 == 0 else runs[::-1]:
                env = with_kernel_variant({**os.environ, "MLX_H2O_NUM_THREADS": str(threads)}, isa)
                step_us = 0.0
                for layer in layers:
                    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--layer", layer, "--rows", str(rows),
                           "--repeats", str(args.repeats)]
                    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
                    r = json.loads(out.splitlines()[-1])
                    step_us += r["median_us"] * r["per_step"]
                    print(f"| {layer} | {r['shape']} q{r['bits']} g{r['group']} | {rows} | {threads} | {r['isa']} | {rnd} | "
                          f"{r['median_us']:.1f} | {r['min_us']:.0f}-{r['max_us']:.0f} | {r['gb_s']:.2f} | "
                          f"{r['gmac_s']:.2f} |", flush=True)
                    if layer == STEP:
                        print(f"| **a decode step's products, one evaluation** | | {rows} | {threads} | {r['isa']} | {rnd} | "
                              f"**{r['median_us'] * r['per_step'] / 1000:.2f} ms** | | | |", flush=True)
                if "all" in args.layer:
                    print(f"| **a decode step's products** | | {rows} | {threads} | {r['isa']} | {rnd} | "
                          f"**{step_us / 1000:.2f} ms** | | | |", flush=True)
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
