"""MLX's own CPU ops right after one of mlx-h2o's kernels ran on the same thread, against the same ops
before any kernel ran: the check for a kernel leaving the vector registers' upper halves dirty
(csrc/kernels/run_entry.inc). MLX's scalar exp mixes SSE with libm's VEX fmaf, and with dirty upper
halves every switch between them stalls: mx.logsumexp over a vocabulary of logits (what mlx-lm's
`generate_step` runs every token) took 44-47x as long after a product before the fix.

    python benchmarks/bench_mlx_after_kernels.py [--repeats 20]

Prints the median µs of each MLX op before and after each kernel, and the ratio (1.0x: no effect).
"""

import argparse
import os
import statistics
import time

import mlx_h2o

mlx_h2o.use_openblas()  # before mlx.core loads, as the commands do
import mlx.core as mx  # noqa: E402

from mlx_h2o import _ext  # noqa: E402


def median_us(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    model, _ = mlx_h2o.load()
    layer = model.layers[0].mlp.gate_proj
    logits = mx.random.normal((1, 49152))
    x = mx.random.normal((1, 1, 576))
    q = mx.random.normal((1, 9, 1, 64))
    kv = mx.random.normal((1, 3, 512, 64))
    mx.eval(logits, x, q, kv)
    mlx_ops = {
        "logsumexp (49152)": lambda: mx.logsumexp(logits, axis=-1),
        "softmax (49152)": lambda: mx.softmax(logits, axis=-1),
    }
    kernels = {
        "quantized_matmul": lambda: _ext.quantized_matmul(x, layer["weight"], layer["scales"], layer["biases"],
                                                          layer.group_size, layer.bits, 8, None),
        "attention": lambda: mlx_h2o.scaled_dot_product_attention_with_scores(q, kv, kv, scale=0.125)[0],
    }
    print(f"load before: {os.getloadavg()[0]:.2f}, kernels: {_ext.kernel_isa()}")
    print("| MLX op | after kernel | µs before any kernel | µs after it | after / before |")
    print("|---|---|---|---|---|")
    clean = {name: median_us(op, args.repeats) for name, op in mlx_ops.items()}  # first: no kernel has run
    for kname, kernel in kernels.items():
        for name, op in mlx_ops.items():
            mx.eval(kernel())
            after = median_us(op, args.repeats)
            print(f"| {name} | {kname} | {clean[name]:.0f} | {after:.0f} | {after / clean[name]:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
