"""Does `mx.compile` of a whole decode step pay on the CPU? The embedded model's greedy step with a
cache that compiles, against the same step uncompiled with the full cache.

    python benchmarks/bench_compiled_step.py                 # 512 tokens of context, 64 steps
    python benchmarks/bench_compiled_step.py --context 2048

A compiled function is traced once for its input shapes, so the cache that compiles keeps fixed-size
buffers (context + steps rows, zero beyond the tokens held) and takes its offset as an array: rows are
written with `mx.slice_update` at that offset, and a mask hides the rows past it from the fused
attention. RoPE then gets an array offset, which mlx-h2o's one-primitive kernel does not take, so
MLX's own rope runs there. The two steps alternate on the same tokens (the uncompiled step's choice
feeds both), and the table gives their median step times and how often their greedy tokens agree.
Run it on a quiet machine: it waits for one and records the load.
"""

import argparse
import os
import statistics
import time

from bench_peer import add_quiet_arguments, wait_quiet


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=64)
    add_quiet_arguments(p)
    args = p.parse_args(argv)

    import mlx_h2o

    mlx_h2o.use_openblas()  # before mlx.core loads
    import mlx.core as mx

    from mlx_h2o.attention import scaled_dot_product_attention_with_scores

    class StaticCache:
        """A layer's rows in (1, H, capacity, D) buffers, `offset` an array (an input of the step)."""

        def __init__(self, keys, values, offset):
            self.keys, self.values, self.offset = keys, values, offset

        def update_and_fetch(self, k, v):
            start = mx.concatenate([mx.zeros((2,), mx.int32), self.offset.reshape(1), mx.zeros((1,), mx.int32)])
            self.keys = mx.slice_update(self.keys, k.astype(self.keys.dtype), start, axes=(0, 1, 2, 3))
            self.values = mx.slice_update(self.values, v.astype(self.values.dtype), start, axes=(0, 1, 2, 3))
            return self.keys, self.values

        def make_mask(self, N, return_array=False, window_size=None):
            return (mx.arange(self.keys.shape[2]) <= self.offset)[None, None, None, :]  # a decode step: N = 1

        def attend(self, queries, keys, values, *, scale, mask=None, sinks=None):
            return scaled_dot_product_attention_with_scores(queries, keys, values, scale=scale, mask=mask, scores=None,
                                                            sinks=sinks)[0]

    model, tokenizer = mlx_h2o.load()
    with open("/usr/share/common-licenses/GPL-3", encoding="utf-8") as f:
        ids = mx.array(tokenizer.encode(f.read() * 4)[: args.context])[None]
    plain = mlx_h2o.make_cache(model, "full")
    for i in range(0, args.context - 1, 256):
        mx.eval(model(ids[:, i : min(i + 256, args.context - 1)], cache=plain))
    capacity = args.context + args.steps
    buffers = []
    for c in plain:
        pad = [(0, 0), (0, 0), (0, capacity - c.offset), (0, 0)]
        buffers += [mx.pad(c.keys[..., : c.offset, :], pad), mx.pad(c.values[..., : c.offset, :], pad)]
    mx.eval(buffers)

    def step(token, offset, *rows):
        caches = [StaticCache(rows[2 * i], rows[2 * i + 1], offset) for i in range(len(plain))]
        y = mx.argmax(model(token, cache=caches)[:, -1:], axis=-1)
        return [y] + [a for c in caches for a in (c.keys, c.values)]

    compiled = mx.compile(step)
    offset = mx.array(args.context - 1, mx.int32)
    y = ids[:, -1:]
    mx.eval(compiled(y, offset, *buffers))  # the trace (not timed; the buffers are not advanced)
    busy, load = wait_quiet(args, first=True)
    times, agree = {"uncompiled": [], "compiled": []}, 0
    for s in range(args.steps):
        t0 = time.perf_counter()
        y_plain = mx.argmax(model(y, cache=plain)[:, -1:], axis=-1)
        mx.eval(y_plain)
        t1 = time.perf_counter()
        out = compiled(y, offset, *buffers)
        buffers = None  # the step's graph holds the only reference: its row writes can reuse the buffers
        mx.eval(out)
        t2 = time.perf_counter()
        times["uncompiled"].append((t1 - t0) * 1e3)
        times["compiled"].append((t2 - t1) * 1e3)
        agree += int(out[0].item() == y_plain.item())
        y, buffers, offset = y_plain, out[1:], offset + 1
    base = statistics.median(times["uncompiled"])
    print(f"\n### A decode step at {args.context} tokens, compiled or not ({args.steps} steps alternating; "
          f"load {load:.2f} at start, {os.getloadavg()[0]:.2f} at end, {busy:.2f} cores busy before)")
    print("| step | p50 ms | min-max ms | speed vs uncompiled | greedy tokens equal |")
    print("|---|---|---|---|---|")
    for name, t in times.items():
        p50 = statistics.median(t)
        print(f"| {name} | {p50:.2f} | {min(t):.2f}-{max(t):.2f} | {base / p50:.2f}x | "
              f"{'—' if name == 'uncompiled' else f'{agree}/{args.steps}'} |")


if __name__ == "__main__":
    main()
