"""What one more primitive costs a decode step: the embedded model decodes through mlx-lm's
generate_step (the next step's graph built while the current one evaluates, as `mlx_lm.generate`
runs), with --extra cheap primitives appended to every layer's output (an elementwise op on one
row: no arithmetic worth the name), alternating with the model as it is, in one process. The step's
growth over the primitives added is the marginal cost of a primitive, dispatch and evaluation
included, on this machine.

    python benchmarks/bench_primitive_cost.py [--context 512] [--extra 10] [--rounds 4] [--op abs]

--chain also times MLX's evaluation alone of a chain of 500 such primitives (built first, then one
mx.eval): the per-primitive cost without the model's kernels around it. Run it on a quiet machine:
it waits for one and records the load.
"""

import argparse
import os
import statistics
import time

from bench_peer import add_quiet_arguments, wait_quiet

OPS = {"abs": lambda mx, x: mx.abs(x), "add": lambda mx, x: x + 0.0}  # "add": a Broadcast and an Add each


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--extra", type=int, default=10, help="primitives added to each layer's output")
    p.add_argument("--op", choices=sorted(OPS), default="abs")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=100, help="decode steps per round and variant")
    p.add_argument("--chain", action="store_true", help="also time the evaluation of a chain of 500 primitives")
    add_quiet_arguments(p)
    args = p.parse_args()

    import mlx_h2o  # isort: skip

    mlx_h2o.use_openblas()  # before mlx.core loads: the prefill's GEMMs
    import mlx.core as mx
    import numpy as np
    from mlx_lm.generate import generate_step

    model, tokenizer = mlx_h2o.load()
    text = open("/usr/share/common-licenses/GPL-3").read()
    ids = tokenizer.encode(text)[: args.context]
    op = OPS[args.op]
    extra = [0]

    class WithExtra:
        """A decoder block whose output passes through extra[0] more primitives."""

        def __init__(self, block):
            self.block = block

        def __getattr__(self, name):
            return getattr(self.block, name)

        def __call__(self, x, *a, **kw):
            out = self.block(x, *a, **kw)
            for _ in range(extra[0]):
                out = op(mx, out)
            return out

    model.model.layers = [WithExtra(b) for b in model.model.layers]

    def decode_ms():
        cache = mlx_h2o.make_cache(model, "full")
        steps, t = [], time.perf_counter()
        for _ in generate_step(mx.array(ids), model, prompt_cache=cache, max_tokens=args.steps):
            now = time.perf_counter()
            steps.append(now - t)
            t = now
        return statistics.median(steps[4:]) * 1e3

    busy, load = wait_quiet(args, first=True)
    print(f"load at start {load:.2f} ({busy:.2f} cores busy)")
    layers = len(model.layers)
    times = {0: [], args.extra: []}
    for _ in range(args.rounds):
        for n in times:
            extra[0] = n
            times[n].append(decode_ms())
    base, more = (statistics.median(times[n]) for n in times)
    per_extra = 2 if args.op == "add" else 1  # primitives one extra op adds
    per = (more - base) / (args.extra * layers * per_extra) * 1e3
    print(f"\n### A decode step at {args.context} tokens with {args.extra} more `{args.op}` per layer "
          f"({args.rounds} rounds alternating, {args.steps} steps each; load {os.getloadavg()[0]:.2f} at the end)")
    print("| extra primitives a step | step ms (median of rounds) | rounds |\n|---|---|---|")
    for n, ts in times.items():
        count = n * layers * per_extra
        print(f"| {count} | {statistics.median(ts):.2f} | {' / '.join(f'{t:.2f}' for t in ts)} |")
    print(f"\none primitive: {per:.1f} µs of the step")

    if args.chain:
        x = mx.random.normal((1, 1, model.args.hidden_size))
        mx.eval(x)
        per_primitive = []
        for _ in range(60):
            y = x
            for _ in range(500):
                y = mx.abs(y)
            t0 = time.perf_counter()
            mx.eval(y)
            per_primitive.append((time.perf_counter() - t0) / 500 * 1e6)
        t = np.array(per_primitive[10:])
        print(f"a chain of 500 primitives, evaluated alone: {np.median(t):.2f} µs each (min {t.min():.2f}, "
              f"max {t.max():.2f}; 50 chains)")


if __name__ == "__main__":
    main()
