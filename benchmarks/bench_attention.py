"""Decode attention on the CPU, side by side in one run: the fused kernel (scores None / mass /
logits) vs stock `mx.fast.scaled_dot_product_attention` vs NumPy reading the same K/V bytes.

    python benchmarks/bench_attention.py [--sizes 512 2048 8192 32768] [--dtypes float32 float16 bfloat16]

Shapes are SmolLM2's decode step: q (1, 9, 1, 64), K/V (1, 3, N, 64). Every variant of one row is
timed round-robin (so machine noise hits all of them alike); the table gives median microseconds per
call, the K+V read rate, and the ratios the project's goals are stated in.
"""

import argparse
import time

import mlx_h2o  # first: BLAS shim before mlx.core  # isort: skip

import mlx.core as mx
import numpy as np

from mlx_h2o.evaluation.report import markdown_table


def interleaved_medians(fns: dict, rounds: int, warmup: int = 2) -> dict:
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: float(np.median(ts)) * 1e6 for name, ts in times.items()}


def attention_row(dtype, n, hq=9, hkv=3, d=64, rounds=None):
    rng = np.random.default_rng(n)
    q, k, v = (mx.array(rng.standard_normal(s).astype(np.float32)).astype(dtype) for s in ((1, hq, 1, d), (1, hkv, n, d), (1, hkv, n, d)))
    mx.eval(q, k, v)
    # NumPy reads the very same bytes (viewed as float32 words, so the read rate is dtype-independent).
    k_np = np.array(k.view(mx.uint8)).view(np.float32)
    v_np = np.array(v.view(mx.uint8)).view(np.float32)
    ours = mlx_h2o.scaled_dot_product_attention_with_scores
    fns = {
        "none": lambda: mx.eval(ours(q, k, v, scale=d**-0.5, scores=None)[0]),
        "mass": lambda: mx.eval(ours(q, k, v, scale=d**-0.5, scores="mass")),
        "logits": lambda: mx.eval(ours(q, k, v, scale=d**-0.5, scores="logits")),
        "stock": lambda: mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=d**-0.5)),
        "numpy": lambda: (k_np.sum(), v_np.sum()),
    }
    rounds = rounds or max(5, min(200, 2_000_000 // n))
    t = interleaved_medians(fns, rounds)
    t["bytes"] = k.nbytes + v.nbytes
    return t


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", type=int, default=[512, 2048, 8192, 32768])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "float16", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=None)
    args = ap.parse_args()
    print(f"kernel: {mlx_h2o._ext.kernel_isa()}, {mlx_h2o._ext.kernel_threads()} threads; MLX {mx.__version__}")
    rows = []
    for name in args.dtypes:
        for n in args.sizes:
            t = attention_row(getattr(mx, name), n, rounds=args.rounds)
            gbs = lambda us: t["bytes"] / us / 1e3  # noqa: E731
            rows.append(
                [
                    name,
                    n,
                    f"{t['none']:.0f}",
                    f"{t['mass']:.0f}",
                    f"{t['logits']:.0f}",
                    f"{t['stock']:.0f}",
                    f"{t['numpy']:.0f}",
                    f"{gbs(t['none']):.1f}",
                    f"{gbs(t['numpy']):.1f}",
                    f"{t['stock'] / t['none']:.1f}x",
                    f"{t['numpy'] / t['none'] * 100:.0f} %",
                    f"{t['mass'] / t['none']:.2f}x",
                ]
            )
            print(" | ".join(str(c) for c in rows[-1]), flush=True)
    print()
    print(
        markdown_table(
            ["dtype", "N", "ours none µs", "ours mass µs", "ours logits µs", "stock µs", "NumPy read µs",
             "ours GB/s", "NumPy GB/s", "stock / ours", "ours vs NumPy rate", "mass / none"],
            rows,
        )
    )


if __name__ == "__main__":
    main()
