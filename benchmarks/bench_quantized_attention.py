"""Decode attention over a quantized KV cache on the CPU, side by side in one run: the fused kernel
reading packed 8-/4-bit K/V (Q K^T in integer arithmetic with int8 queries, the default, and with
float32 queries) vs mlx-lm's quantized SDPA (two quantized_matmuls) vs our dense kernel and stock
`mx.fast.scaled_dot_product_attention` on the float16 cache.

    python benchmarks/bench_quantized_attention.py [--sizes 2048 8192 32768] [--group-size 64]

Shapes are SmolLM2's decode step: q (1, 9, 1, 64), K/V (1, 3, N, 64), float16. Timed round-robin;
median microseconds per call and ratios.
"""

import argparse
import os

import mlx_h2o  # isort: skip

mlx_h2o.use_openblas()  # this benchmark opts in: OpenBLAS matmuls, before mlx.core loads

import mlx.core as mx
import numpy as np
from bench_attention import interleaved_medians
from mlx_lm.models.base import quantized_scaled_dot_product_attention

from mlx_h2o.evaluation.report import markdown_table


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", type=int, default=[2048, 8192, 32768])
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=None)
    args = ap.parse_args()
    gs = args.group_size
    print(f"kernel: {mlx_h2o._ext.kernel_isa()}, {mlx_h2o._ext.kernel_threads()} threads; group size {gs}")
    rows = []
    for n in args.sizes:
        rng = np.random.default_rng(n)
        q, k, v = (mx.array(rng.standard_normal(s).astype(np.float32)).astype(mx.float16) for s in ((1, 9, 1, 64), (1, 3, n, 64), (1, 3, n, 64)))
        packed = {b: (mx.quantize(k, group_size=gs, bits=b), mx.quantize(v, group_size=gs, bits=b)) for b in (8, 4)}
        mx.eval(q, k, v, packed)
        ours_q = mlx_h2o.quantized_scaled_dot_product_attention_with_scores
        fns = {}
        def float_queries(f):
            def run():
                mlx_h2o._ext.set_attention_int8_queries(False)
                try:
                    f()
                finally:
                    mlx_h2o._ext.set_attention_int8_queries(True)

            return run

        for b, (kq, vq) in packed.items():
            fns[f"fused q{b}"] = lambda kq=kq, vq=vq, b=b: mx.eval(ours_q(q, kq, vq, scale=0.125, bits=b, group_size=gs, scores=None)[0])
            fns[f"fused q{b} float q"] = float_queries(fns[f"fused q{b}"])
            fns[f"fused q{b} mass"] = lambda kq=kq, vq=vq, b=b: mx.eval(ours_q(q, kq, vq, scale=0.125, bits=b, group_size=gs))
            fns[f"mlx-lm q{b}"] = lambda kq=kq, vq=vq, b=b: mx.eval(
                quantized_scaled_dot_product_attention(q, kq, vq, scale=0.125, mask=None, group_size=gs, bits=b))
        fns["fused f16"] = lambda: mx.eval(mlx_h2o.scaled_dot_product_attention_with_scores(q, k, v, scale=0.125, scores=None)[0])
        fns["stock f16"] = lambda: mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125))
        t = interleaved_medians(fns, args.rounds or max(3, min(100, 400_000 // n)))
        for b in (8, 4):
            kb = sum(a.nbytes for a in packed[b][0] + packed[b][1])
            rows.append([
                n, b, f"{kb / 2**20:.2f}", f"{t[f'fused q{b}']:.0f}", f"{t[f'fused q{b} float q']:.0f}", f"{t[f'fused q{b} mass']:.0f}",
                f"{t[f'mlx-lm q{b}']:.0f}", f"{t['fused f16']:.0f}", f"{t['stock f16']:.0f}",
                f"{t[f'mlx-lm q{b}'] / t[f'fused q{b}']:.1f}x", f"{t['fused f16'] / t[f'fused q{b}']:.2f}x",
                f"{t['fused f16'] / t[f'fused q{b} float q']:.2f}x", f"{kb / t[f'fused q{b}'] / 1e3:.1f}",
            ])
            print(" | ".join(map(str, rows[-1])), flush=True)
    print()
    print(markdown_table(
        ["N", "bits", "K+V MiB", "fused µs", "fused float-q µs", "fused+mass µs", "mlx-lm quantized µs", "fused f16 µs",
         "stock f16 µs", "mlx-lm / fused", "fused f16 / fused q", "fused f16 / fused float-q", "fused GB/s"], rows))
    print(f"uptime: {os.popen('uptime').read().strip()}")


if __name__ == "__main__":
    main()
