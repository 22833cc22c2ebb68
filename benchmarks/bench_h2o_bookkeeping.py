"""h2o decode speed with the score bookkeeping evaluated every BOOKKEEPING_EVAL_EVERY tokens against
left to the next eviction (the behaviour before), alternating in one process.

    python benchmarks/bench_h2o_bookkeeping.py                  # the embedded model, M = 2048 and 256
    python benchmarks/bench_h2o_bookkeeping.py --model DIR --max-kv-size 512

Left to the next eviction, the bookkeeping grew memory with every token (caches/h2o/cache.py); the
deferred work is paid at the end of each run, inside the timing. Each run: a fresh cache, the
--prompt-tokens prompt in 128-token steps, then --steps greedy decode steps timed. Prints the median
and spread of --rounds runs per variant and the load. Run it on a quiet machine.
"""

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench_peer import add_quiet_arguments, wait_quiet


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="an mlx-lm model directory (default: convert the embedded model)")
    p.add_argument("--max-kv-size", type=int, nargs="+", default=[2048, 256], help="h2o budgets M to measure")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--steps", type=int, default=128, help="decode steps timed per run")
    p.add_argument("--rounds", type=int, default=6, help="runs per variant, alternating")
    add_quiet_arguments(p)
    args = p.parse_args(argv)

    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_h2o.caches.h2o.lane import Lane

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from mlx_h2o.convert import convert

            model_dir = str(convert(Path(tmp) / "model"))
        model, tokenizer = load(model_dir)
    with open("/usr/share/common-licenses/GPL-3", encoding="utf-8") as f:
        prompt = mx.array(tokenizer.encode(f.read())[: args.prompt_tokens])[None]
    evaluated = Lane.bookkeeping

    def run(M, variant):
        Lane.bookkeeping = evaluated if variant == "evaluated" else (lambda self: [])
        cache = make_prompt_cache(model, policy="h2o", max_kv_size=M)
        for i in range(0, prompt.shape[1], 128):
            model(prompt[:, i : i + 128], cache=cache)
            mx.eval([c.state for c in cache])
        y = mx.array([[5]])
        tic = time.perf_counter()
        for _ in range(args.steps):
            y = mx.argmax(model(y, cache=cache)[:, -1:], axis=-1)
            mx.eval(y)
        mx.eval([c.state for c in cache])  # the deferred work, inside the timing
        return args.steps / (time.perf_counter() - tic)

    wait_quiet(args, first=True)
    print(f"load at start {os.getloadavg()[0]:.2f}")
    print("| M | evaluated every few tokens (tok/s) | left to the next eviction (tok/s) | ratio |")
    print("| --- | --- | --- | --- |")
    try:
        for M in args.max_kv_size:
            tok_s = {"evaluated": [], "deferred": []}
            for r in range(args.rounds):
                for variant in ("evaluated", "deferred") if r % 2 == 0 else ("deferred", "evaluated"):
                    tok_s[variant].append(run(M, variant))
            a, b = (statistics.median(tok_s[v]) for v in ("evaluated", "deferred"))
            spread = {v: f"[{min(x):.1f}–{max(x):.1f}]" for v, x in tok_s.items()}
            print(f"| {M} | {a:.1f} {spread['evaluated']} | {b:.1f} {spread['deferred']} | {a / b:.3f} |", flush=True)
    finally:
        Lane.bookkeeping = evaluated
    print(f"load at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
