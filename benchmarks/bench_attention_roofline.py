"""Is decode attention over packed K/V bound by memory or by arithmetic on this CPU? A roofline per
storage format: the bytes a key costs, the kernel's time per key where the rows are cache-resident
(its arithmetic), and the time per key at long contexts against the time the same bytes take to read.

    python benchmarks/bench_attention_roofline.py [--long 8192 32768] [--threads 1 2]

SmolLM2's decode step: float32 queries (1, 9, 1, 64) over K/V (1, 3, N, 64) held as float32, float16,
8-bit or 4-bit rows (group size 64, float16 scales and biases; int8 queries, the default); a key is one
position of one kv head (3 query rows read it). "arithmetic ns/key" is the kernel's time per key at
N = 4096 with one thread, where every format's rows (at most 6 MB) stay in the 32 MB last-level cache:
its cost with memory out of the way. "read ns/key" is NumPy summing the same bytes at the long N with
one thread: what a core streams from memory. At T threads a format is compute-bound where arithmetic / T
exceeds the read time: fewer bytes then do not make it faster. Thread counts run in fresh processes
(MLX_H2O_NUM_THREADS is read once per process).
"""

import argparse
import json
import os
import subprocess
import sys

FORMATS = ("float32", "float16", "q8", "q4")


def worker(sizes, rounds):
    import mlx_h2o  # isort: skip

    import mlx.core as mx
    import numpy as np
    from bench_attention import interleaved_medians

    out = {}
    for n in sizes:
        rng = np.random.default_rng(n)
        q = mx.array(rng.standard_normal((1, 9, 1, 64)).astype(np.float32))
        k, v = (mx.array(rng.standard_normal((1, 3, n, 64)).astype(np.float32)) for _ in range(2))
        rows = {"float32": (k, v), "float16": (k.astype(mx.float16), v.astype(mx.float16))}
        for bits in (8, 4):
            rows[f"q{bits}"] = tuple(mx.quantize(a.astype(mx.float16), group_size=64, bits=bits) for a in (k, v))
        mx.eval(q, rows)
        fns, nbytes, read = {}, {}, {}
        for name, (kr, vr) in rows.items():
            if name.startswith("q"):
                bits = int(name[1:])
                fns[name] = lambda kr=kr, vr=vr, bits=bits: mx.eval(mlx_h2o.quantized_scaled_dot_product_attention_with_scores(
                    q, kr, vr, scale=0.125, bits=bits, group_size=64, scores=None)[0])
                arrays = [*kr, *vr]
            else:
                fns[name] = lambda kr=kr, vr=vr: mx.eval(mlx_h2o.scaled_dot_product_attention_with_scores(
                    q, kr, vr, scale=0.125, scores=None)[0])
                arrays = [kr, vr]
            nbytes[name] = sum(a.nbytes for a in arrays)
            # NumPy sums the very same bytes as 64-bit words: the rate one core streams them from memory.
            words = [np.array(a.view(mx.uint8)).reshape(-1).view(np.int64) for a in arrays]
            read[name] = lambda words=words: [w.sum() for w in words]
        t = interleaved_medians({**fns, **{f"read {k}": f for k, f in read.items()}}, rounds)
        out[n] = {name: {"us": t[name], "read_us": t[f"read {name}"], "bytes": nbytes[name]} for name in fns}
    return out


def run(threads, sizes, rounds):
    env = {**os.environ, "MLX_H2O_NUM_THREADS": str(threads)}
    cmd = [sys.executable, __file__, "--worker", "--sizes", *map(str, sizes), "--rounds", str(rounds)]
    res = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    return {int(n): r for n, r in json.loads(res.stdout.strip().splitlines()[-1]).items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--long", nargs="+", type=int, default=[8192, 32768])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--sizes", nargs="+", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.sizes, args.rounds)))
        return
    from mlx_h2o.evaluation.report import markdown_table

    print(f"load before: {os.getloadavg()[0]:.2f}", flush=True)
    keys = lambda n: 3 * n  # noqa: E731  (kv heads x positions)
    cached = run(1, [4096], args.rounds)[4096]
    arith = {f: cached[f]["us"] * 1e3 / keys(4096) for f in FORMATS}
    long = {th: run(th, args.long, max(5, args.rounds // 4)) for th in args.threads}
    rows = []
    for n in args.long:
        for f in FORMATS:
            one = long[args.threads[0]][n][f]
            row = [n, f, f"{one['bytes'] / keys(n):.0f}", f"{arith[f]:.1f}", f"{one['read_us'] * 1e3 / keys(n):.1f}"]
            for th in args.threads:
                r = long[th][n][f]
                row += [f"{r['us'] * 1e3 / keys(n):.1f}", f"{r['bytes'] / r['us'] / 1e3:.1f}"]
            f16 = {th: long[th][n]["float16"]["us"] / long[th][n][f]["us"] for th in args.threads}
            row.append(" / ".join(f"{f16[th]:.2f}x" for th in args.threads))
            bound = "compute" if arith[f] / args.threads[-1] > one["read_us"] * 1e3 / keys(n) else "memory"
            rows.append(row + [bound])
    head = ["N", "rows", "bytes/key", "arithmetic ns/key (1 thread, N = 4096 cached)", "read ns/key (NumPy, 1 thread)"]
    for th in args.threads:
        head += [f"ns/key {th} thr", f"GB/s {th} thr"]
    head += [f"speed vs float16 ({' / '.join(map(str, args.threads))} thr)", f"bound at {args.threads[-1]} thr"]
    print(markdown_table(head, rows))
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
