"""Decode attention on the CPU, side by side in one run: the fused kernel (scores None / mass /
logits) vs stock `mx.fast.scaled_dot_product_attention` vs NumPy reading the same K/V bytes.

    python benchmarks/bench_attention.py [--sizes 512 2048 8192 32768] [--dtypes float32 float16 bfloat16]
        [--ops ext mlx]

--ops picks who runs mlx-h2o's op (src/mlx_h2o/_ops.py): the C++ extension ("ext"), MLX's own
mx.fast op from an MLX built with patches/mlx ("mlx"), or both side by side in the same rounds.

Shapes are SmolLM2's decode step: q (1, 9, 1, 64), K/V (1, 3, N, 64). Every variant of one row is
timed round-robin (so machine noise hits all of them alike); the table gives median microseconds per
call, the K+V read rate, and the ratios the project's goals are stated in.
"""

import argparse
import time

import mlx_h2o  # isort: skip

mlx_h2o.use_openblas()  # this benchmark opts in: OpenBLAS matmuls, before mlx.core loads

import mlx.core as mx
import numpy as np

from mlx_h2o import _ops
from mlx_h2o.evaluation.report import markdown_table

SCORES = {"none": None, "mass": "mass", "logits": "logits"}


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


def attention_row(dtype, n, ops, hq=9, hkv=3, d=64, rounds=None):
    rng = np.random.default_rng(n)
    q, k, v = (mx.array(rng.standard_normal(s).astype(np.float32)).astype(dtype) for s in ((1, hq, 1, d), (1, hkv, n, d), (1, hkv, n, d)))
    mx.eval(q, k, v)
    # NumPy reads the very same bytes (viewed as float32 words, so the read rate is dtype-independent).
    k_np = np.array(k.view(mx.uint8)).view(np.float32)
    v_np = np.array(v.view(mx.uint8)).view(np.float32)
    ours = mlx_h2o.scaled_dot_product_attention_with_scores

    def op(impl, scores):
        def run():
            _ops.set_implementation(impl)
            mx.eval(ours(q, k, v, scale=d**-0.5, scores=scores))

        return run

    fns = {f"{impl} {name}": op(impl, scores) for name, scores in SCORES.items() for impl in ops}
    fns["stock"] = lambda: mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=d**-0.5))
    fns["numpy"] = lambda: (k_np.sum(), v_np.sum())
    rounds = rounds or max(5, min(200, 2_000_000 // n))
    t = interleaved_medians(fns, rounds)
    t["bytes"] = k.nbytes + v.nbytes
    return t


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", type=int, default=[512, 2048, 8192, 32768])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "float16", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--ops", nargs="+", choices=("ext", "mlx"), default=[_ops.implementation()],
                    help="implementations of the op (default: MLX_H2O_OPS's); the first is the baseline")
    args = ap.parse_args()
    for impl in args.ops:
        _ops.set_implementation(impl)  # fails clearly when this MLX lacks the ops
    base = args.ops[0]
    print(f"kernel: {mlx_h2o._ext.kernel_isa()}, {mlx_h2o._ext.kernel_threads()} threads; MLX {mx.__version__}; "
          f"op from {', '.join(args.ops)}")
    header = ["dtype", "N"] + [f"{impl} {name} µs" for name in SCORES for impl in args.ops]
    header += ["stock µs", "NumPy read µs", f"{base} GB/s", "NumPy GB/s", f"stock / {base}",
               f"{base} vs NumPy rate", f"{base} mass / none"]
    header += [f"{impl} / {base} {name}" for impl in args.ops[1:] for name in SCORES]
    rows = []
    for name in args.dtypes:
        for n in args.sizes:
            t = attention_row(getattr(mx, name), n, args.ops, rounds=args.rounds)
            gbs = lambda us: t["bytes"] / us / 1e3  # noqa: E731
            none = t[f"{base} none"]
            row = [name, n] + [f"{t[f'{impl} {s}']:.0f}" for s in SCORES for impl in args.ops]
            row += [
                f"{t['stock']:.0f}",
                f"{t['numpy']:.0f}",
                f"{gbs(none):.1f}",
                f"{gbs(t['numpy']):.1f}",
                f"{t['stock'] / none:.1f}x",
                f"{t['numpy'] / none * 100:.0f} %",
                f"{t[f'{base} mass'] / none:.2f}x",
            ]
            row += [f"{t[f'{impl} {s}'] / t[f'{base} {s}']:.2f}x" for impl in args.ops[1:] for s in SCORES]
            rows.append(row)
            print(" | ".join(str(c) for c in rows[-1]), flush=True)
    print()
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
