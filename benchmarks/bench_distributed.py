"""What a shared h2o selection costs under tensor parallelism: the all-reduce of its scores per
eviction, against a decode step. Run on every rank by mlx.launch (one machine: ring backend, loopback):

    mlx.launch --backend ring -n 3 --hosts 127.0.0.1 --connections-per-ip 1 \\
        --env MLX_H2O_NUM_THREADS=1 --python "$(command -v python)" benchmarks/bench_distributed.py

The embedded SmolLM2 (3 kv heads: 3 ranks, one head each) is sharded with mlx-lm's `model.shard`, an
h2o cache with select='layer' (M = --max-kv-size, evict_every = M/16 by default) prefills --context
tokens and decodes --steps tokens. Rank 0 prints:

- the median decode step and its spread;
- the all-reduce one eviction adds: one all_sum of the (1, 1, M) summed priorities per layer, timed
  alone (--repeats each), times the layers;
- that cost per decode step (one eviction per evict_every steps), as a fraction of the step;
- the KV bytes this rank holds against what one rank would.
Check the load first (`uptime`): a spinning all-reduce on an oversubscribed machine is slow.
"""

import argparse
import os
import time

import mlx.core as mx
import numpy as np

import mlx_h2o
from mlx_h2o import make_cache
from mlx_h2o.distributed import shard


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--max-kv-size", type=int, default=256)
    p.add_argument("--repeats", type=int, default=200)
    args = p.parse_args()

    group = mx.distributed.init()
    rank, size = group.rank(), group.size()
    model, tokenizer = mlx_h2o.load()
    whole_kv_heads = model.layers[0].self_attn.n_kv_heads
    if size > 1:
        shard(model, group)
    with open("/usr/share/common-licenses/GPL-3", encoding="utf-8") as f:
        ids = tokenizer.encode(f.read())[: args.context + args.steps]
    M = args.max_kv_size
    caches = make_cache(model, "h2o", max_kv_size=M, select="layer")
    mx.eval(model(mx.array(ids[: args.context])[None], cache=caches))
    steps = []
    for t in ids[args.context :]:
        start = time.perf_counter()
        mx.eval(model(mx.array([[t]]), cache=caches))
        steps.append(time.perf_counter() - start)
    evict_every = caches[0].budget.evict_every or max(1, M // 16)

    scores = mx.random.uniform(shape=(1, 1, M))
    mx.eval(mx.distributed.all_sum(scores, group=group))
    start = time.perf_counter()
    for _ in range(args.repeats):
        mx.eval(mx.distributed.all_sum(scores, group=group))
    per_call = (time.perf_counter() - start) / args.repeats
    layers = len(caches)
    per_eviction = per_call * layers
    kv = sum(c.nbytes for c in caches)
    if rank == 0:
        step = float(np.median(steps))
        print(f"ranks {size} (one machine, load {os.getloadavg()[0]:.2f}); h2o select=layer, M={M}, evict_every={evict_every}, "
              f"context {args.context}, {args.steps} steps")
        print("| quantity | value |\n|---|---|")
        print(f"| decode step, median (p10-p90) | {step * 1e3:.1f} ms ({np.percentile(steps, 10) * 1e3:.1f}-"
              f"{np.percentile(steps, 90) * 1e3:.1f}) |")
        print(f"| all_sum of (1, 1, {M}) float32 | {per_call * 1e3:.3f} ms |")
        print(f"| per eviction ({layers} layers) | {per_eviction * 1e3:.2f} ms |")
        print(f"| per decode step (1 eviction / {evict_every} steps) | {per_eviction / evict_every * 1e3:.3f} ms = "
              f"{per_eviction / evict_every / step * 100:.2f} % of a step |")
        print(f"| KV bytes on this rank | {kv} ({whole_kv_heads // max(size, 1) if size > 1 else whole_kv_heads} of "
              f"{whole_kv_heads} kv heads) |")


if __name__ == "__main__":
    main()
