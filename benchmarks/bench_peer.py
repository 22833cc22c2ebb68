"""mlx-h2o vs llama.cpp (llama-cpp-python) on the same GGUF, prompt and thread count: prefill and
decode tok/s and peak RSS, at each context, for mlx-h2o's full cache and h2o(M=--budget, default 256); one
ratio per row.

    python benchmarks/bench_peer.py [--quick] [--contexts 512 2048] [--budget 256] [--gen 64] [--rounds 2] [--threads 2]
        [--peer-python build/venv-llamacpp/bin/python]

llama-cpp-python is an optional benchmark dependency, never a test dependency; install it in its own
venv (it compiles llama.cpp, natively for this CPU, on install):
    python3 -m venv build/venv-llamacpp && build/venv-llamacpp/bin/pip install llama-cpp-python

Every measurement is a fresh process (so peak RSS is that engine's alone): it loads the model, feeds
the same token ids (the embedded SmolLM2 GGUF, `mlx_h2o.loading.default_model_path()`, real English
from the default corpus) in 512-token prefill chunks, then greedily decodes --gen tokens. Engines
alternate within each round and the order flips between rounds, so both see the same machine noise.
mlx-h2o decodes with mlx-lm's own `generate_step` (what a user runs), the fused attention on and its
default CPU weights. Prints each round's rows, then the medians with llama.cpp's full cache as the
reference of every row, and `uptime` before and after.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

PREFILL_CHUNK = 512
DEFAULT_PEER_PYTHON = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "build", "venv-llamacpp", "bin", "python")


def prompt_tokens(context):
    import mlx_h2o

    mlx_h2o.use_openblas()  # before mlx.core loads
    from mlx_h2o.evaluation import load_corpus, token_samples
    from mlx_h2o.loading import load

    _, tokenizer = load()
    return token_samples(tokenizer, load_corpus(), 1, context, seed=1)[0][1]


def peak_rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker_peer(model_path, tokens, gen, threads):
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(model_path=model_path, n_ctx=len(tokens) + gen + 8, n_threads=threads, n_threads_batch=threads,
                n_batch=PREFILL_CHUNK, verbose=False)
    n_vocab = llm.n_vocab()

    def greedy():  # the last evaluated position's logits (llama-cpp-python keeps no others by default)
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))))

    t0 = time.perf_counter()
    llm.eval(tokens)
    token = greedy()
    t1 = time.perf_counter()
    out = [token]
    for _ in range(gen - 1):
        llm.eval([token])
        token = greedy()
        out.append(token)
    t2 = time.perf_counter()
    return dict(prefill_s=t1 - t0, decode_s=t2 - t1, tokens=out)


def worker_ours(tokens, gen, cache_name, budget):
    import mlx_h2o  # isort: skip

    mlx_h2o.use_openblas()  # before mlx.core loads
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    model, _ = mlx_h2o.load()
    mlx_h2o.use_fast_cpu_attention(True)
    cache = mlx_h2o.make_cache(model, "h2o", max_kv_size=budget) if cache_name == "h2o" else mlx_h2o.make_cache(model, "full")
    out = []
    t0 = time.perf_counter()
    steps = generate_step(mx.array(tokens), model, max_tokens=gen, sampler=lambda lp: mx.argmax(lp, axis=-1),
                          prompt_cache=cache, prefill_step_size=PREFILL_CHUNK)
    for i, (token, _) in enumerate(steps):
        if i == 0:
            t1 = time.perf_counter()
        out.append(int(token))
    t2 = time.perf_counter()
    return dict(prefill_s=t1 - t0, decode_s=t2 - t1, tokens=out)


def run_worker(args):
    tokens = json.loads(sys.stdin.read())
    if args.worker == "peer":
        r = worker_peer(args.model_path, tokens, args.gen, args.threads)
    else:
        r = worker_ours(tokens, args.gen, args.worker.split(":", 1)[1], args.budget)
    r["peak_rss_mib"] = peak_rss_mib()
    print(json.dumps(r))


def measure(engine, tokens, args):
    """One fresh process: {'prefill_tok_s', 'decode_tok_s', 'peak_rss_mib', 'tokens'}."""
    python = args.peer_python if engine == "peer" else sys.executable
    env = {**os.environ, "MLX_H2O_NUM_THREADS": str(args.threads), "OPENBLAS_NUM_THREADS": str(args.threads),
           "OMP_NUM_THREADS": str(args.threads)}
    cmd = [python, os.path.abspath(__file__), "--worker", engine, "--gen", str(args.gen), "--threads", str(args.threads),
           "--model-path", args.model_path, "--budget", str(args.budget)]
    r = subprocess.run(cmd, input=json.dumps(tokens), capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"{engine} worker failed:\n{r.stderr[-3000:]}")
    res = json.loads(r.stdout.strip().splitlines()[-1])
    res["prefill_tok_s"] = len(tokens) / res["prefill_s"]
    res["decode_tok_s"] = (args.gen - 1) / res["decode_s"]
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", nargs="+", type=int, default=[512, 2048])
    ap.add_argument("--gen", type=int, default=64, help="tokens generated after the prompt")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--caches", nargs="+", default=["full", "h2o"], choices=["full", "h2o"])
    ap.add_argument("--budget", type=int, default=256, help="max_kv_size M of mlx-h2o's h2o cache")
    ap.add_argument("--peer-python", default=DEFAULT_PEER_PYTHON, help="a python with llama-cpp-python installed")
    ap.add_argument("--quick", action="store_true", help="512 context, 32 tokens, 1 round")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model-path", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return run_worker(args)
    if args.quick:
        args.contexts, args.gen, args.rounds = [512], 32, 1
    from mlx_h2o.loading import default_model_path

    args.model_path = str(default_model_path())
    if not os.path.exists(args.peer_python):
        sys.exit(f"no llama-cpp-python at {args.peer_python}; see this file's docstring, or pass --peer-python")
    print(f"uptime before: {os.popen('uptime').read().strip()}", flush=True)
    engines = ["peer"] + [f"ours:{c}" for c in args.caches]
    runs = {}
    for ctx in args.contexts:
        tokens = prompt_tokens(ctx)
        for rnd in range(args.rounds):
            order = engines if rnd % 2 == 0 else engines[::-1]
            for engine in order:
                r = measure(engine, tokens, args)
                runs.setdefault((ctx, engine), []).append(r)
                print(f"ctx {ctx} round {rnd} {engine:9s} prefill {r['prefill_tok_s']:7.1f} tok/s  decode "
                      f"{r['decode_tok_s']:6.1f} tok/s  peak RSS {r['peak_rss_mib']:6.0f} MiB", flush=True)
    print(f"uptime after: {os.popen('uptime').read().strip()}\n")
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("prefill_tok_s", "decode_tok_s", "peak_rss_mib")}
           for k, v in runs.items()}
    header = ["context", "engine", "cache", "prefill tok/s", "decode tok/s", "peak RSS MiB",
              "prefill vs llama.cpp", "decode vs llama.cpp", "RSS vs llama.cpp"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for ctx in args.contexts:
        peer = med[(ctx, "peer")]
        for engine in engines:
            m = med[(ctx, engine)]
            name, cache = ("llama.cpp", "full") if engine == "peer" else ("mlx-h2o", f"h2o(M={args.budget})" if engine.endswith("h2o") else "full")
            print(f"| {ctx} | {name} | {cache} | {m['prefill_tok_s']:.1f} | {m['decode_tok_s']:.1f} | {m['peak_rss_mib']:.0f} | "
                  f"{m['prefill_tok_s'] / peer['prefill_tok_s']:.2f}x | {m['decode_tok_s'] / peer['decode_tok_s']:.2f}x | "
                  f"{m['peak_rss_mib'] / peer['peak_rss_mib']:.2f}x |")
    # Same greedy continuation? (different kernels round differently; a report, not a check)
    for ctx in args.contexts:
        a, b = runs[(ctx, "peer")][0]["tokens"], runs[(ctx, engines[1])][0]["tokens"]
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        print(f"ctx {ctx}: greedy tokens agree with llama.cpp for the first {same} of {len(a)}")


if __name__ == "__main__":
    main()
