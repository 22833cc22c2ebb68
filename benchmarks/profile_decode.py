"""Where the CPU time of a decode step goes, by part, for the demo's caches at one byte budget: a
`perf record` of each cache's decode steps (after the same context), its samples grouped by symbol
into the quantized matmuls, the attention kernel, the rotations, the packed row writes, MLX's graph
evaluation, malloc, the kernel's scheduling and Python.

    BUILD_TYPE=RelWithDebInfo ./scripts/dev_build.sh        # the extension with its symbols (Release strips them)
    PYTHONPATH=src:benchmarks python benchmarks/profile_decode.py --cache "window fp" --cache h2o --steps 400

Needs Linux `perf` (user-space samples of its own process: kernel.perf_event_paranoid <= 2). The
numbers are CPU milliseconds per step summed over every thread (the kernels' two threads, the
Python thread), so a part's share of the wall-clock step is not its share here; compare the caches.
Timings are not what this measures: use bench_bytes_decode.py for speed.
"""

import argparse
import collections
import os
import re
import signal
import subprocess
import tempfile
import time

# (part, regular expression over "dso symbol" of perf's report), first match wins
PARTS = [
    ("quantized matmuls (and the kernel pool's threads)", r"qmm_columns|run_quantized_matmul|quantized_matmul|ThreadPool|parallel_for"),
    ("attention kernel", r"qk_tile|pv_tile|attend_range|finish_block|run_attention|for_row_groups|store_scalar|attention_cpu"),
    ("rotations (float64 sums)", r"rotate_row|RotationPlan|hadamard_signs"),
    ("packed row writes", r"QuantizeRowsInto|quantize_row"),
    ("norms, RoPE, SwiGLU kernels", r"rms_norm|rope_cpu|swiglu|exp_ops|norm_rope"),
    ("MLX graph evaluation, arrays, buffers", r"mlx::core::|Hashtable"),
    ("malloc / free / memset", r"malloc|_int_free|cfree|unlink_chunk|malloc_consolidate|memset|memmove|memcpy"),
    ("kernel: scheduling, yields, switches", r"\[k\]"),
    ("Python", r"libpython|_Py|Py[A-Z]|dict_|unicode|gc_collect"),
]


def parts(report: str):
    """Percent of the samples per part, from `perf report --sort dso,sym --stdio` output, and the
    largest symbols left in "other" (so a renamed function is seen, not silently regrouped)."""
    shares, other = collections.Counter(), []
    for line in report.splitlines():
        m = re.match(r"\s+([\d.]+)%\s+(.*)", line)
        if not m:
            continue
        name = next((part for part, rx in PARTS if re.search(rx, m.group(2))), "other")
        shares[name] += float(m.group(1))
        if name == "other" and float(m.group(1)) >= 0.2:
            other.append(f"{' '.join(m.group(2).split())[:90]} {m.group(1)}%")
    return shares, other


def samples(report: str) -> int:
    m = re.search(r"# Samples: ([\d.]+)([KM]?)", report)
    return int(float(m.group(1)) * {"": 1, "K": 1e3, "M": 1e6}[m.group(2)])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--fraction", type=float, default=0.125, help="the budget, a fraction of the full cache's bytes")
    p.add_argument("--steps", type=int, default=400, help="decode steps recorded per cache")
    p.add_argument("--cache", action="append", default=[], help="a demo cache (full, window fp, window 8-bit, h2o); repeatable")
    p.add_argument("--frequency", type=int, default=4000, help="perf's samples per second")
    args = p.parse_args(argv)
    names = args.cache or ["window fp", "h2o"]

    import mlx_h2o

    mlx_h2o.use_openblas()  # before mlx.core loads
    import mlx.core as mx

    from mlx_h2o.evaluation.demo import CHUNK, DEMO_CACHES
    from mlx_h2o.evaluation.suite import equal_byte_specs

    model, tokenizer = mlx_h2o.load()
    with open("/usr/share/common-licenses/GPL-3", encoding="utf-8") as f:
        ids = mx.array(tokenizer.encode(f.read() * 4)[: args.context])[None]
    specs = {s.name: s for s in equal_byte_specs(model, args.context, [args.fraction], caches=DEMO_CACHES)}
    unknown = [n for n in names if n not in specs]
    if unknown:
        raise SystemExit(f"unknown cache {unknown}: choose from {sorted(specs)}")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            cache = mlx_h2o.make_cache(model, specs[name].policy, **specs[name].options)
            for i in range(0, args.context - 1, CHUNK):
                mx.eval(model(ids[:, i : min(i + CHUNK, args.context - 1)], cache=cache))
            data = os.path.join(tmp, "perf.data")
            perf = subprocess.Popen(["perf", "record", "-q", "-F", str(args.frequency), "-o", data, "-p", str(os.getpid())],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)  # (perf attaches)
            y, t0 = ids[:, -1:], time.perf_counter()
            for _ in range(args.steps):
                y = mx.argmax(model(y, cache=cache)[:, -1:], axis=-1)
                mx.eval(y)
            wall = (time.perf_counter() - t0) / args.steps * 1e3
            perf.send_signal(signal.SIGINT)
            perf.wait()
            report = subprocess.run(["perf", "report", "-i", data, "--no-children", "--sort", "dso,sym", "--stdio"],
                                    capture_output=True, text=True, check=True).stdout
            cpu_ms = samples(report) / args.frequency * 1e3 / args.steps
            results[name] = (wall, cpu_ms, *parts(report))
            print(f"{name}: {wall:.2f} ms a step (wall, under perf), {cpu_ms:.1f} ms of CPU", flush=True)
    print(f"\n### CPU ms per decode step by part ({args.context} tokens, {args.fraction:g} of the full cache's bytes, "
          f"{args.steps} steps each; load {os.getloadavg()[0]:.2f} at the end)")
    print("| part | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for part in [p for p, _ in PARTS] + ["other"]:
        print(f"| {part} | " + " | ".join(f"{r[1] * r[2][part] / 100:.2f}" for r in results.values()) + " |")
    print("| **all (CPU)** | " + " | ".join(f"{r[1]:.1f}" for r in results.values()) + " |")
    print("| wall ms a step (under perf) | " + " | ".join(f"{r[0]:.1f}" for r in results.values()) + " |")
    for name, r in results.items():
        print(f"\n{name}, the largest symbols in 'other': " + "; ".join(r[3][:8]))


if __name__ == "__main__":
    main()
