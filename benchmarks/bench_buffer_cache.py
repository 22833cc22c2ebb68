"""MLX's cache of freed buffers against the peak RSS, prefill and decode of bench_peer's mlx-h2o run:
each --limits value (MiB, or `mlx` for MLX's own 32 MiB) in fresh processes, the limits alternating
within each round, with large buffers in their own maps as the `mlx-h2o` command runs.

    python benchmarks/bench_buffer_cache.py [--limits mlx 0 1 4 8 16] [--contexts 512 2048]
        [--caches full h2o] [--rounds 2] [--gen 64]

Why it matters: MLX reuses a cached buffer only for a request of about its size, so a prefill
layer's temporaries of every size stay cached beside the live ones, while smaller limits fault the
larger temporaries in afresh at every layer. `limit_mlx_buffer_cache()` (src/mlx_h2o/_allocator.py)
took its default from this table. Prints each process's row, then the medians per context, cache and
limit; run it on a quiet machine (it waits for one, as bench_peer.py).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

from bench_peer import PREFILL_CHUNK, add_quiet_arguments, peak_rss_mib, prompt_tokens, wait_quiet, worker_ours


def run_worker(args):
    import mlx_h2o

    mlx_h2o.use_openblas()  # before mlx.core loads
    mlx_h2o.use_mmap_for_large_buffers()
    if args.worker_limit != "mlx":
        mlx_h2o.limit_mlx_buffer_cache(int(float(args.worker_limit) * 2**20))
    # "glibc": worker_ours leaves the allocators as set above
    r = worker_ours(json.loads(sys.stdin.read()), args.gen, args.worker_cache, args.budget, "glibc")
    r["peak_rss_mib"] = peak_rss_mib()
    print(json.dumps(r))


def measure(args, limit, cache, tokens):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker-limit", limit, "--worker-cache", cache,
           "--gen", str(args.gen), "--budget", str(args.budget)]
    env = {**os.environ, "MLX_H2O_NUM_THREADS": str(args.threads), "OPENBLAS_NUM_THREADS": str(args.threads)}
    r = subprocess.run(cmd, input=json.dumps(tokens), capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"worker (limit {limit}, {cache}) failed:\n{r.stderr[-3000:]}")
    res = json.loads(r.stdout.strip().splitlines()[-1])
    return res["peak_rss_mib"], res["prefill_s"], (args.gen - 1) / res["decode_s"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limits", nargs="+", default=["mlx", "0", "1", "4", "8", "16"],
                    help="MLX cache limits in MiB, or mlx (MLX's own)")
    ap.add_argument("--contexts", nargs="+", type=int, default=[512, 2048])
    ap.add_argument("--caches", nargs="+", default=["full", "h2o"], metavar="SPEC", help="policy specs, as bench_peer.py's")
    ap.add_argument("--budget", type=int, default=512, help="max_kv_size of a bounded cache given without one")
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    add_quiet_arguments(ap, "the first round")
    ap.add_argument("--worker-limit", help=argparse.SUPPRESS)
    ap.add_argument("--worker-cache", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker_limit:
        return run_worker(args)
    for limit in args.limits:
        if limit != "mlx":
            try:
                if float(limit) < 0:
                    raise ValueError
            except ValueError:
                ap.error(f"--limits takes MiB >= 0 or 'mlx', got {limit!r}")
    tokens = {c: prompt_tokens(c) for c in args.contexts}
    print(f"uptime before: {os.popen('uptime').read().strip()}; prefill chunk {PREFILL_CHUNK}", flush=True)
    wait_quiet(args, first=True)
    rows = {}
    for rnd in range(args.rounds):
        order = args.limits if rnd % 2 == 0 else args.limits[::-1]
        for context in args.contexts:
            for cache in args.caches:
                for limit in order:
                    busy, load = wait_quiet(args)
                    rss, prefill, decode = measure(args, limit, cache, tokens[context])
                    rows.setdefault((context, cache, limit), []).append((rss, prefill, decode))
                    print(f"round {rnd + 1} ctx {context} {cache:5s} limit {limit:>4s}: peak RSS {rss:6.1f} MiB, prefill "
                          f"{prefill:.3f} s, decode {decode:5.1f} tok/s (before it: {busy:.2f} cores busy, load {load:.2f})",
                          flush=True)
    print(f"uptime after: {os.popen('uptime').read().strip()}\n")
    def name(limit):
        return "MLX's own (32 MiB)" if limit == "mlx" else f"{limit} MiB"

    print(f"| context | cache | MLX cache limit | peak RSS MiB | prefill s | prefill vs {name(args.limits[0])} | decode tok/s |")
    print("|---|---|---|---|---|---|---|")
    for context in args.contexts:
        for cache in args.caches:
            base = statistics.median(p for _, p, _ in rows[(context, cache, args.limits[0])])
            for limit in args.limits:
                r = rows[(context, cache, limit)]
                rss, prefill, decode = (statistics.median(x[i] for x in r) for i in range(3))
                print(f"| {context} | {cache} | {name(limit)} | {rss:.1f} | {prefill:.3f} | {prefill / base:.2f}x | {decode:.1f} |")


if __name__ == "__main__":
    main()
