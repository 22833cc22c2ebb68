"""End to end: SmolLM2-135M decode speed with mlx-lm's stock attention (`--attention stock`,
`mlx_h2o.use_fast_cpu_attention(False)`) vs the fused CPU kernel (the default of every policy's
caches), full KV cache, at several context lengths, in one run.

    python benchmarks/bench_decode.py [--contexts 2048 8192] [--steps 32]

For each context the prompt (real English from the default corpus) is prefilled once, then decode
steps alternate between the two attention paths on the same cache, so both see the same context
length and the same machine noise. Prints tok/s, p50 step latency and the speedup.
"""

import argparse
import time

import mlx_h2o  # isort: skip

mlx_h2o.use_openblas()  # this benchmark opts in: OpenBLAS matmuls, before mlx.core loads

import mlx.core as mx
import numpy as np
from tqdm.auto import tqdm

from mlx_h2o import hook
from mlx_h2o.evaluation import load_corpus, token_samples
from mlx_h2o.evaluation.report import markdown_table


def prefill(model, cache, tokens, chunk=512):
    x = mx.array(tokens)[None]
    for i in tqdm(range(0, x.shape[1], chunk), desc=f"prefill {x.shape[1]}", leave=False):
        mx.eval(model(x[:, i : i + chunk], cache=cache))
        mx.eval([c.state for c in cache])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", nargs="+", type=int, default=[2048, 8192])
    ap.add_argument("--steps", type=int, default=32, help="decode steps per attention path")
    args = ap.parse_args()
    model, tokenizer = mlx_h2o.load()
    corpus = load_corpus()
    print(f"BLAS: {mlx_h2o.blas_backend()}; kernel: {mlx_h2o._ext.kernel_isa()}, {mlx_h2o._ext.kernel_threads()} threads")
    rows = []
    for ctx in args.contexts:
        tokens = token_samples(tokenizer, corpus, 1, ctx, seed=1)[0][1]
        cache = mlx_h2o.make_cache(model, "full")
        mlx_h2o.use_fast_cpu_attention(True)
        prefill(model, cache, tokens)
        y = mx.array(tokens[-1:])[None]
        times = {"stock": [], "fused": []}
        for step in tqdm(range(2 * args.steps + 2), desc=f"decode @ {ctx}", leave=False):
            path = "fused" if step % 2 else "stock"
            mlx_h2o.use_fast_cpu_attention(path == "fused")
            t = time.perf_counter()
            y = mx.argmax(model(y, cache=cache)[:, -1:], axis=-1)
            mx.eval(y)
            if step >= 2:  # the first two steps warm both paths up
                times[path].append(time.perf_counter() - t)
        hook.use_fast_cpu_attention(None)
        s, f = (np.array(times[k]) for k in ("stock", "fused"))
        rows.append([ctx, f"{1 / s.mean():.1f}", f"{1 / f.mean():.1f}", f"{np.median(s) * 1e3:.1f}", f"{np.median(f) * 1e3:.1f}", f"{s.mean() / f.mean():.2f}x"])
        print(" | ".join(map(str, rows[-1])), flush=True)
    print()
    print(markdown_table(["context", "stock tok/s", "fused tok/s", "stock p50 ms", "fused p50 ms", "speedup"], rows))


if __name__ == "__main__":
    main()
