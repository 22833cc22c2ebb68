"""Which weight format should the embedded model use on this backend? One run, side by side:
dequantized float32 / bfloat16 / float16 vs MLX's packed 4-bit (embedding 8-bit) quantized weights.

    python benchmarks/bench_weights.py [--context 512] [--steps 32]

Prints load time, prefill tok/s, decode tok/s (full cache, after --context tokens), weight bytes and
the teacher-forced perplexity on a licence text, with ratios against float32.
"""

import argparse
import math
import time

import mlx_h2o  # isort: skip

mlx_h2o.use_openblas()  # this benchmark opts in: OpenBLAS matmuls, before mlx.core loads

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_h2o.evaluation import decode_benchmark, load_corpus, teacher_forced_nll, token_samples
from mlx_h2o.evaluation.report import markdown_table


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--modes", nargs="+", default=["float32", "bfloat16", "float16", "quantized"])
    args = ap.parse_args()
    print(f"BLAS: {mlx_h2o.blas_backend()}")
    rows = []
    tokens = None
    for mode in args.modes:
        t0 = time.perf_counter()
        model, tokenizer = mlx_h2o.load(weights=mode)
        load_s = time.perf_counter() - t0
        if tokens is None:
            tokens = token_samples(tokenizer, load_corpus(), 1, args.context + 1)[0][1]
        ppl = math.exp(teacher_forced_nll(model, tokens[:512]).mean())
        r = decode_benchmark(model, mlx_h2o.make_cache(model, "full"), tokens, steps=args.steps)
        weight_mb = sum(v.nbytes for _, v in tree_flatten(model.parameters())) / 2**20
        rows.append((mode, load_s, r["prefill_tok_s"], r["decode_tok_s"], r["p50_ms"], weight_mb, ppl))
        del model
        mx.clear_cache()
    base = rows[0]
    print(
        markdown_table(
            ["weights", "load s", "prefill tok/s", "decode tok/s", "decode vs " + base[0], "p50 ms", "weights MB", "PPL (512 tok)"],
            [
                [m, f"{ls:.1f}", f"{pt:.1f}", f"{dt:.1f}", f"{dt / base[3]:.2f}x", f"{p50:.1f}", f"{mb:.0f}", f"{ppl:.3f}"]
                for m, ls, pt, dt, p50, mb, ppl in rows
            ],
        )
    )


if __name__ == "__main__":
    main()
