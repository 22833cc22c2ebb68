"""H2O cost on the embedded model, side by side in one run:

1. decode speed at a long context: h2o(M) (default and evict_every=1) vs the full cache at that
   context vs the full cache at M tokens (what the attention of a bounded cache costs, eviction and
   scoring included), interleaved rounds;
2. eviction overhead vs slack: h2o(M) evicting every 1, 4, 16, ... tokens vs the same cache holding
   about M entries without evicting (the step cost is then attention + scoring only);
3. a long prompt prefilled in chunks: the most entries any layer ever held (bound: M + chunk);
4. a decode soak (--soak N): N tokens decoded one at a time through h2o(M) and through the full
   cache on a small random llama, entries held and process RSS every N/16 steps.

    python benchmarks/bench_h2o.py [--context 8192] [--budget 512] [--slack 1 4 16 64] [--long-prompt 32768]
    python benchmarks/bench_h2o.py --parts 4 --soak 16384 --budget 256
    python benchmarks/bench_h2o.py --parts 1 --budget 256 --also h2o:evicted_bits=2,rotate=true,score=cumulative

Step times are medians over interleaved rounds (other work on the machine shifts them all alike).
"""

import argparse
import time

import mlx_h2o  # isort: skip

mlx_h2o.use_openblas()  # this benchmark opts in: OpenBLAS matmuls, before mlx.core loads

import mlx.core as mx
import numpy as np
from tqdm.auto import tqdm

from mlx_h2o.caches.h2o import H2OKVCache
from mlx_h2o.evaluation import decode_benchmark, decode_step_times, load_corpus, token_samples
from mlx_h2o.evaluation.memory import _current_rss_bytes
from mlx_h2o.evaluation.report import markdown_table
from mlx_h2o.evaluation.runner import parse_specs


def _prefill(model, cache, tokens, chunk=512):
    for i in range(0, len(tokens), chunk):
        mx.eval(model(mx.array(tokens[i : i + chunk])[None], cache=cache))
    mx.eval([c.state for c in cache])


def speed_at_context(model, tokens, context, budget, steps, rounds, score, also=()):
    """Decode tok/s per configuration, the configurations interleaved over `rounds` (medians);
    `also`: more policy specs (`name:key=value,...`, e.g. an h2o variant) timed in the same rounds."""
    configs = [
        (f"full @ {context}", "full", {}, context),
        (f"full @ {budget}", "full", {}, budget),
        (f"h2o(M={budget}) @ {context}", "h2o", {"max_kv_size": budget, "score": score}, context),
        (f"h2o(M={budget}, evict_every=1) @ {context}", "h2o", {"max_kv_size": budget, "score": score, "evict_every": 1}, context),
    ]
    configs += [(f"{spec.label} @ {context}", spec.policy, spec.options, context) for spec in parse_specs(also, [budget])]
    runs = {label: [] for label, *_ in configs}
    for _ in tqdm(range(rounds), desc="speed rounds", leave=False):
        for label, policy, opts, ctx in configs:
            runs[label].append(decode_benchmark(model, mlx_h2o.make_cache(model, policy, **opts), tokens[: ctx + 1], steps=steps))
    med = {label: {k: float(np.median([r[k] for r in rs])) for k in ("decode_tok_s", "p50_ms", "kv_bytes")} for label, rs in runs.items()}
    base = med[configs[0][0]]["decode_tok_s"]
    return markdown_table(
        ["cache", "decode tok/s (median)", f"vs full @ {context}", "p50 ms", "KV MB", "tok/s per round"],
        [[lab, f"{r['decode_tok_s']:.1f}", f"{r['decode_tok_s'] / base:.2f}x", f"{r['p50_ms']:.1f}", f"{r['kv_bytes'] / 2**20:.1f}",
          " ".join(f"{x['decode_tok_s']:.1f}" for x in runs[lab])] for lab, r in med.items()],
    )


def eviction_overhead(model, tokens, budget, slacks, steps, rounds, score):
    """Median decode-step time per slack, against a cache of the same size that never evicts."""
    # The reference never evicts; it starts below M so that on average it holds about M entries.
    configs = [("no eviction (same size)", {"max_kv_size": budget + steps * rounds + 64, "score": score}, max(budget - steps * rounds // 2, 1))]
    configs += [(f"evict_every={e}", {"max_kv_size": budget, "score": score, "evict_every": e}, 2 * budget) for e in slacks]
    caches = []
    for label, opts, ctx in configs:
        cache = mlx_h2o.make_cache(model, "h2o", **opts)
        _prefill(model, cache, tokens[:ctx - 1])
        decode_step_times(model, cache, mx.array([[tokens[ctx - 1]]]), 1)  # evicts the last chunk's excess
        for c in cache:
            if isinstance(c, H2OKVCache):
                c.peak = c.size()  # count what decoding holds, not the chunked prefill's M + chunk
        caches.append((label, cache, [], tokens[ctx]))
    for _ in tqdm(range(rounds), desc="overhead rounds", leave=False):
        for label, cache, times, tok in caches:
            times += decode_step_times(model, cache, mx.array([[tok]]), steps)
    base = np.median(caches[0][2])
    rows = []
    for label, cache, times, _ in caches:
        h = [c for c in cache if isinstance(c, H2OKVCache)]
        med = np.median(times)
        rows.append([label, f"{med * 1e3:.1f}", f"{(med / base - 1) * 100:+.1f} %", max(c.peak for c in h), h[0].evictions])
    return markdown_table(["h2o(M=%d)" % budget, "median step ms", "overhead", "peak entries while decoding", "evictions"], rows)


def long_prompt(model, tokens, budget, n, chunk, score):
    prompt = (tokens * (n // len(tokens) + 1))[:n]
    cache = mlx_h2o.make_cache(model, "h2o", max_kv_size=budget, score=score)
    mx.reset_peak_memory()
    t = time.perf_counter()
    for i in tqdm(range(0, n, chunk), desc=f"prefill {n} tokens", leave=False):
        mx.eval(model(mx.array(prompt[i : i + chunk])[None], cache=cache))
    seconds = time.perf_counter() - t
    h = [c for c in cache if isinstance(c, H2OKVCache)]
    return markdown_table(
        ["prompt tokens", "chunk", "M", "most entries held", "bound M + chunk", "entries after", "prefill tok/s", "MLX peak MB"],
        [[n, chunk, budget, max(c.peak for c in h), budget + chunk, max(c.size() for c in h), f"{n / seconds:.0f}", f"{mx.get_peak_memory() / 2**20:.0f}"]],
    )


def soak(budget, steps):
    """Entries held and process RSS while decoding `steps` tokens: h2o(M) vs the full cache, on a
    small random llama (4 layers, 2 kv heads x 64; the cache, not the model, is what is measured)."""
    from mlx_lm.models import llama

    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs(model_type="llama", hidden_size=256, num_hidden_layers=4, intermediate_size=512,
                                        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=512))
    mx.eval(model.parameters())
    every = max(steps // 16, 1)
    rows = []
    for label, policy, opts in [(f"h2o(M={budget})", "h2o", {"max_kv_size": budget}), ("full", "full", {})]:
        cache = mlx_h2o.make_cache(model, policy, **opts)
        y = mx.array([[1]])
        rss0 = _current_rss_bytes()
        for i in tqdm(range(1, steps + 1), desc=f"soak {label}", leave=False):
            y = mx.argmax(model(y, cache=cache)[:, -1:], axis=-1)
            if i % every == 0:
                mx.eval(y)
                held = max(c.size() for c in cache)
                rows.append([label, i, held, f"{(_current_rss_bytes() - rss0) / 2**20:+.1f}", f"{mx.get_active_memory() / 2**20:.1f}"])
        del cache
    return markdown_table(["cache", "tokens decoded", "entries held (max layer)", "RSS growth MB", "MLX active MB"], rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed per configuration (per round)")
    ap.add_argument("--slack", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--slack-budget", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--long-prompt", type=int, default=32768, help="0 skips part 3")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--score", default=None, help="h2o scoring rule (default: the policy's)")
    ap.add_argument("--also", nargs="+", default=[], metavar="SPEC",
                    help="part 1: more policies timed in the same rounds, name:key=value,... (bounded ones default to --budget)")
    ap.add_argument("--parts", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--soak", type=int, default=16384, help="decode steps of part 4")
    args = ap.parse_args()
    if args.parts == [4]:
        print(f"\n## Decode soak: {args.soak} tokens\n")
        print(soak(args.budget, args.soak))
        return
    score = args.score or mlx_h2o.POLICIES["h2o"].option("score").default
    print(f"BLAS: {mlx_h2o.blas_backend()}; h2o score={score}")
    model, tokenizer = mlx_h2o.load()
    tokens = token_samples(tokenizer, load_corpus(), 1, max(args.context, 2 * args.slack_budget) + 512)[0][1]
    if 1 in args.parts:
        print(f"\n## Decode speed at {args.context} tokens of context\n")
        print(speed_at_context(model, tokens, args.context, args.budget, args.steps, args.rounds, score, args.also))
    if 2 in args.parts:
        print("\n## Eviction overhead vs slack\n")
        print(eviction_overhead(model, tokens, args.slack_budget, args.slack, args.steps, args.rounds, score))
    if 3 in args.parts and args.long_prompt:
        print("\n## Long prompt, chunked prefill\n")
        print(long_prompt(model, tokens, args.budget, args.long_prompt, args.chunk, score))
    if 4 in args.parts:
        print(f"\n## Decode soak: {args.soak} tokens\n")
        print(soak(args.budget, args.soak))


if __name__ == "__main__":
    main()
