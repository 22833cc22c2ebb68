"""Decode steps of the demo's caches at one byte budget, side by side: where h2o at `max_kv_bytes`
spends its step against the sliding windows of the same bytes.

    python benchmarks/bench_bytes_decode.py                       # 2048 tokens, 1/8 of the full cache's bytes
    python benchmarks/bench_bytes_decode.py --fraction 0.25 --steps 256
    python benchmarks/bench_bytes_decode.py --cache "h2o as given=h2o:max_kv_bytes={B},kv_bits=4/8,rotate=true"

The caches are the demo's (`mlx-h2o demo`): full, the fp window (mlx-lm's RotatingKVCache), the 8-bit
window and h2o at the budget, and any --cache given. Each takes the same --context tokens (the GPL-3
text, in the demo's 256-token chunks), then the caches decode in turn, one greedy step each, so a
slow period of the machine hits all of them. Per cache: the median time to build the step's graph (Python) and to
evaluate it, their sum, the mean step and the speed it gives relative to the fp window's (tokens
over time, so the periodic steps count), and the primitives one step's graph
has (`mx.export_to_dot`); and the fused kernel alone over h2o's rows, dense and packed, and over
what an h2o layer and the fp window hold as the step reads it (segments, rotations, scores). To compare
two configurations, give one as a --cache (steps alternate in one process); two builds, run it
under each (PYTHONPATH=A, then B, ...). Run it on a quiet machine: it waits for one and records the load.

Those steps are synchronous: build the graph, then evaluate it. mlx_lm.generate builds the next
step's graph while the current one evaluates (`generate_step`, async_eval). --pipelined-rounds
(default 4) then decodes --pipelined-tokens through generate_step per cache and round, the caches
in turn, and reports each cache's median tok/s relative to the fp window's: the speed an mlx-lm user
sees.
"""

import argparse
import collections
import os
import statistics
import time

from bench_peer import add_quiet_arguments, wait_quiet


def kernel_times(mx, rows: int, heads: int, kv_heads: int, head_dim: int, rounds: int = 5, reps: int = 200) -> dict:
    """Median µs of one decode-shaped fused attention call (with scores) over `rows` K/V rows,
    dense float32 and packed at 8 and 4 bits (group 32), formats alternating."""
    from mlx_h2o.attention import PackedKV, attention_with_scores

    q = mx.random.normal((1, heads, 1, head_dim))
    k, v = (mx.random.normal((1, kv_heads, rows, head_dim)) for _ in range(2))

    def packed(x, bits):
        return PackedKV(*mx.quantize(x, group_size=32, bits=bits), bits, 32)

    segments = {"fp32": [(k, v)], "8-bit": [(packed(k, 8), packed(v, 8))], "4-bit": [(packed(k, 4), packed(v, 4))]}
    mx.eval(q, segments)
    times = collections.defaultdict(list)
    for _ in range(rounds):
        for name, seg in segments.items():
            t0 = time.perf_counter()
            for _ in range(reps):
                mx.eval(attention_with_scores(q, seg, scale=head_dim**-0.5, scores="mass"))
            times[name].append((time.perf_counter() - t0) / reps * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}


def layer_kernel_times(mx, lane, window_rows: int, heads: int, kv_heads: int, head_dim: int, rounds: int = 9,
                       reps: int = 200) -> dict:
    """µs (min, median) of one decode-shaped attention call as a step makes it: over an h2o layer's
    segments (`lane`: its sink, packed and newest rows), with its rotations and scores; over the
    fp window's `window_rows` float32 rows; and over 8 float32 rows (what a lone call costs whatever
    it reads: evaluation, waking the kernel's threads). The cases alternate within each round."""
    from mlx_h2o.attention import attention_with_scores

    segments, (q_rotation, out_rotation) = lane.segments(), lane.store.rotations() or (None, None)
    q = mx.random.normal((1, heads, 1, head_dim))
    window, lone = ([(mx.random.normal((1, kv_heads, n, head_dim)),) * 2] for n in (window_rows, 8))
    mx.eval(q, window, lone)
    scale = head_dim**-0.5
    cases = {
        "h2o layer (rotations, scores)": lambda: attention_with_scores(q, segments, scale=scale, scores="mass",
                                                                       q_rotation=q_rotation, out_rotation=out_rotation),
        f"fp window ({window_rows} rows)": lambda: attention_with_scores(q, window, scale=scale, scores=None),
        "8 rows (a lone call's fixed cost)": lambda: attention_with_scores(q, lone, scale=scale, scores=None),
    }
    times = collections.defaultdict(list)
    for _ in range(rounds):
        for name, call in cases.items():
            t0 = time.perf_counter()
            for _ in range(reps):
                mx.eval(call())
            times[name].append((time.perf_counter() - t0) / reps * 1e6)
    return {name: (min(t), statistics.median(t)) for name, t in times.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--fraction", type=float, default=0.125, help="the budget, a fraction of the full cache's bytes")
    p.add_argument("--steps", type=int, default=128, help="decode steps per cache")
    p.add_argument("--cache", action="append", default=[], metavar="NAME=SPEC",
                   help="another cache to step beside the demo's (repeatable): a policy spec where {B} is the budget in bytes, "
                        "{M} the fp window's entries")
    p.add_argument("--pipelined-rounds", type=int, default=4, help="rounds of decoding through mlx_lm's generate_step (0: none)")
    p.add_argument("--pipelined-tokens", type=int, default=32, help="tokens a cache decodes per round through generate_step")
    add_quiet_arguments(p)
    args = p.parse_args(argv)

    import mlx_h2o

    mlx_h2o.use_openblas()  # before mlx.core loads
    import mlx.core as mx

    from mlx_h2o.evaluation.demo import CHUNK, DEMO_CACHES
    from mlx_h2o.evaluation.speed import graph_primitives
    from mlx_h2o.evaluation.suite import equal_byte_specs, parse_caches

    extra = parse_caches(args.cache)  # (a bad spec fails before the model loads)

    model, tokenizer = mlx_h2o.load()
    with open("/usr/share/common-licenses/GPL-3", encoding="utf-8") as f:
        ids = mx.array(tokenizer.encode(f.read() * 4)[: args.context])[None]
    specs = equal_byte_specs(model, args.context, [args.fraction], caches=DEMO_CACHES + extra)
    caches = {}
    for s in specs:
        cache = mlx_h2o.make_cache(model, s.policy, **s.options)
        for i in range(0, args.context - 1, CHUNK):
            mx.eval(model(ids[:, i : min(i + CHUNK, args.context - 1)], cache=cache))
        caches[s.name] = cache
    busy, load = wait_quiet(args, first=True)
    print(f"load at start {load:.2f} ({busy:.2f} cores busy)", flush=True)
    y = {name: ids[:, -1:] for name in caches}
    build, run, counts = collections.defaultdict(list), collections.defaultdict(list), {}
    for step in range(args.steps):
        for name, cache in caches.items():
            t0 = time.perf_counter()
            out = model(y[name], cache=cache)
            t1 = time.perf_counter()
            if step == 2:  # a step that is neither the first nor a compaction
                counts[name] = graph_primitives(out)
            y[name] = mx.argmax(out[:, -1:], axis=-1)
            mx.eval(y[name])
            build[name].append((t1 - t0) * 1e3)
            run[name].append((time.perf_counter() - t1) * 1e3)
    M = max(c.budget.max_kv_size for c in caches["h2o"] if hasattr(c, "budget"))
    args_model = model.args
    kernel = kernel_times(mx, M, args_model.num_attention_heads, args_model.num_key_value_heads,
                          args_model.hidden_size // args_model.num_attention_heads)
    steps = {name: [a + b for a, b in zip(build[name], run[name])] for name in caches}
    total = {name: statistics.median(t) for name, t in steps.items()}
    # Speed is tokens over time: the mean step, which counts the steps that do periodic work (a
    # compaction every evict_every tokens) that the median leaves out.
    mean = {name: statistics.fmean(t) for name, t in steps.items()}
    window = mean.get("window fp")
    print(f"\n### Decode steps at {args.fraction:g} of the full cache's bytes, {args.context} tokens "
          f"({args.steps} steps each, alternating; load {load:.2f} at start, {os.getloadavg()[0]:.2f} at end)")
    print("| cache | options | build ms | evaluate ms | step ms | mean step ms | speed vs fp window | primitives | most frequent |")
    print("|---|---|---|---|---|---|---|---|---|")
    for s in specs:
        n = s.name
        top = ", ".join(f"{k} {v}" for k, v in counts[n].most_common(4))
        print(f"| {n} | {dict(s.options) or '—'} | {statistics.median(build[n]):.2f} | {statistics.median(run[n]):.2f} | "
              f"{total[n]:.2f} | {mean[n]:.2f} | {window / mean[n]:.2f}x | {sum(counts[n].values())} | {top} |")
    print(f"\nThe fused kernel alone, one layer's decode call over h2o's {M} rows: "
          + ", ".join(f"{name} {us:.0f} µs" for name, us in kernel.items()))
    h2o_lane = next(c.lanes[0] for c in caches["h2o"] if getattr(c, "lanes", None))
    window_rows = next(dict(s.options)["max_kv_size"] for s in specs if s.name == "window fp")
    layer = layer_kernel_times(mx, h2o_lane, window_rows, args_model.num_attention_heads, args_model.num_key_value_heads,
                               args_model.hidden_size // args_model.num_attention_heads)
    print("One layer's attention call as the step makes it, µs (min / median of 9 rounds): "
          + ", ".join(f"{name} {lo:.0f} / {med:.0f}" for name, (lo, med) in layer.items()))
    if args.pipelined_rounds > 0:
        pipelined(args, model, caches, {name: y[name][0] for name in caches})


def pipelined(args, model, caches: dict, last: dict) -> None:
    """Decode through mlx_lm's generate_step, --pipelined-tokens per cache and round, the caches in
    turn; print each cache's median tok/s (from its first token to its last: the first includes
    generate_step's own prompt step) and the ratio to the fp window's."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    busy, load = wait_quiet(args)
    speeds = collections.defaultdict(list)
    for _ in range(args.pipelined_rounds):
        for name, cache in caches.items():
            times = []
            for token, _ in generate_step(last[name], model, max_tokens=args.pipelined_tokens + 1, prompt_cache=cache):
                times.append(time.perf_counter())
                last[name] = mx.array([token])
            speeds[name].append(args.pipelined_tokens / (times[-1] - times[0]))
    window = statistics.median(speeds["window fp"])
    print(f"\n### Through mlx_lm's generate_step ({args.pipelined_rounds} rounds of {args.pipelined_tokens} tokens a cache, "
          f"in turn; load {load:.2f} at start, {os.getloadavg()[0]:.2f} at end)")
    print("| cache | tok/s (median) | rounds | speed vs fp window |")
    print("|---|---|---|---|")
    for name, v in speeds.items():
        print(f"| {name} | {statistics.median(v):.1f} | {' / '.join(f'{x:.1f}' for x in v)} | {statistics.median(v) / window:.2f}x |")


if __name__ == "__main__":
    main()
