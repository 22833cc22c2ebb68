"""Decode step times of h2o against the full cache under mlx-lm's `generate_step`: the median, the
99th percentile and the steps that stand out, so periodic work (compactions every evict_every)
shows as what it costs.

    python benchmarks/bench_h2o_steps.py                        # 512 and 2048 tokens of context, M = 512
    python benchmarks/bench_h2o_steps.py --contexts 8192 --rounds 2
    python benchmarks/bench_h2o_steps.py --kv-dtype float16       # both caches' rows in float16

Each run: a fresh cache, the context (GPL-3, repeated) prefilled in 512-token chunks, then --tokens
greedy steps, each step's time taken as generate_step yields it. Caches alternate within a round.
After the first round's runs, --count-steps more steps of each cache are built one at a time and
their graphs' primitives counted (`mx.export_to_dot`, untimed): the mean a step, h2o's compactions
included (M / 16 steps apart per layer, staggered over the layers).
To compare two builds, run it under each alternately (PYTHONPATH=A, then B, ...). Run it on a quiet
machine: it waits for one, and records the load.
"""

import argparse
import os
import statistics
import time

from bench_peer import add_quiet_arguments, wait_quiet


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--max-kv-size", type=int, default=512, help="h2o's M")
    p.add_argument("--tokens", type=int, default=257, help="greedy decode steps per run")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kv-dtype", help="both caches' kv_dtype (unset: the policies' default, float16 for a float32 model)")
    p.add_argument("--count-steps", type=int, default=64, help="steps whose graphs' primitives are counted after round 1 (0: none)")
    add_quiet_arguments(p)
    args = p.parse_args(argv)

    import mlx_h2o

    mlx_h2o.use_openblas()  # before mlx.core loads
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from mlx_h2o.evaluation.speed import graph_primitives
    from mlx_h2o.storage import KV_DTYPES

    if args.kv_dtype not in (None, *KV_DTYPES):
        p.error(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, got {args.kv_dtype!r}")

    model, tokenizer = mlx_h2o.load()
    with open("/usr/share/common-licenses/GPL-3", encoding="utf-8") as f:
        ids = tokenizer.encode(f.read() * 4)

    primitives = {}  # (context, cache) -> mean primitives of a decode step's graph

    def run(context, name, count):
        rows = {} if args.kv_dtype is None else {"kv_dtype": args.kv_dtype}
        cache = mlx_h2o.make_cache(model, "full", **rows) if name == "full" else mlx_h2o.make_cache(model, "h2o", max_kv_size=args.max_kv_size, **rows)
        times, y = [], None
        for y, _ in generate_step(mx.array(ids[:context]), model, max_tokens=args.tokens, prompt_cache=cache,
                                  sampler=lambda lp: mx.argmax(lp, axis=-1), prefill_step_size=512):
            times.append(time.perf_counter())
        if count:
            total = 0
            for _ in range(count):  # (after the timed steps: building a graph twice would slow them)
                logits = model(mx.array([[int(y)]]), cache=cache)
                total += sum(graph_primitives(logits).values())
                y = mx.argmax(logits[0, -1])
                mx.eval(y)
            primitives[(context, name)] = total / count
        return [(b - a) * 1e3 for a, b in zip(times, times[1:])]  # the first yield ends the prefill

    busy, load = wait_quiet(args, first=True)
    print(f"load at start {load:.2f} ({busy:.2f} cores busy)")
    runs = {}
    for r in range(args.rounds):
        for context in args.contexts:
            for name in ("full", "h2o") if r % 2 == 0 else ("h2o", "full"):
                steps = run(context, name, args.count_steps if r == 0 else 0)
                runs.setdefault((context, name), []).append(steps)
                s = sorted(steps)
                print(f"  round {r + 1}, {context} tokens, {name}: p50 {s[len(s) // 2]:.1f} ms, p99 {s[int(0.99 * len(s))]:.1f} ms, "
                      f"{1e3 * len(s) / sum(s):.1f} tok/s (load {os.getloadavg()[0]:.2f})", flush=True)

    rows = args.kv_dtype or "the policies' default dtype"
    print(f"\nh2o M = {args.max_kv_size}; rows in {rows}; medians over {args.rounds} runs [min-max]\n")
    print("| context | cache | decode tok/s | vs full | step p50 ms | p99 ms | p99 / p50 | steps > 1.5x p50 | primitives a step |")
    print("|---|---|---|---|---|---|---|---|---|")

    def med(values):
        return statistics.median(values), min(values), max(values)

    for context in args.contexts:
        full_tok_s = med([1e3 * len(s) / sum(s) for s in runs[(context, "full")]])[0]
        for name in ("full", "h2o"):
            per_run = []
            for steps in runs[(context, name)]:
                s = sorted(steps)
                p50, p99 = s[len(s) // 2], s[int(0.99 * len(s))]
                per_run.append((1e3 * len(s) / sum(s), p50, p99, p99 / p50, sum(x > 1.5 * p50 for x in s) / len(s)))
            tok_s, p50, p99, ratio, slow = (med([x[i] for x in per_run]) for i in range(5))
            count = f"{primitives[(context, name)]:.0f}" if (context, name) in primitives else "-"
            print(f"| {context} | {name} | {tok_s[0]:.1f} [{tok_s[1]:.1f}-{tok_s[2]:.1f}] | {tok_s[0] / full_tok_s:.2f}x | {p50[0]:.1f} | "
                  f"{p99[0]:.1f} | {ratio[0]:.2f} [{ratio[1]:.2f}-{ratio[2]:.2f}] | {100 * slow[0]:.1f} % | {count} |")
    print(f"\nload at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
