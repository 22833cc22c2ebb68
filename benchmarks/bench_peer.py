"""mlx-h2o vs llama.cpp (llama-cpp-python) on the same GGUF, prompt and thread count: prefill and
decode tok/s and peak RSS, at each context, for mlx-h2o's caches (--caches: policy specs, default its full
cache and h2o with M = --budget, default 512); one ratio per row.

    python benchmarks/bench_peer.py [--quick] [--contexts 512 2048 8192] [--caches full h2o full:kv_dtype=float16]
        [--budget 512] [--gen 64] [--rounds 2]
        [--threads 2] [--peer-python build/venv-llamacpp/bin/python] [--ours stock=PYTHON fork=build/venv-fork/bin/python]
        [--allocators mmap glibc] [--isas best avx2]
        [--max-load 1.0] [--allow-load]

--ours names each mlx-h2o path and the python that runs it: the default is this python (stock MLX
with mlx-h2o's extension kernels); `fork=build/venv-fork/bin/python` adds the fork's wheels (MLX and
mlx-lm with the series, `scripts/series.py build`). Other pythons than this one run without
PYTHONPATH, so that each imports its own installed mlx_h2o.

A quiet machine or no result: llama.cpp's thread pool spin-waits, and any other work on the machine
collapses it (a ratio taken under load says nothing). Before the first round the 1-minute load must
be below --max-load (it waits up to --wait seconds, then refuses unless --allow-load). Before each
measurement it samples /proc/stat for a second and waits while other processes keep more than
--max-busy of a core busy; each row records that busy share and the load average.

llama-cpp-python is an optional benchmark dependency, never a test dependency; install it in its own
venv (it compiles llama.cpp, natively for this CPU, on install):
    python3 -m venv build/venv-llamacpp && build/venv-llamacpp/bin/pip install llama-cpp-python
On a CPU that reports AMX where the VM does not grant it (the peer's worker dies in libggml-cpu with a
general protection fault), build it without AMX and with the rest of the native set, e.g. on an
AVX512 Xeon:
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX_VNNI=ON
      -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF
      -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" build/venv-llamacpp/bin/pip install --no-cache-dir llama-cpp-python

Every measurement is a fresh process (so peak RSS is that engine's alone): it loads the model, feeds
the same token ids (the embedded SmolLM2 GGUF, `mlx_h2o.loading.default_model_path()`, real English
from the default corpus) in 512-token prefill chunks, then greedily decodes --gen tokens. Engines
alternate within each round and the order flips between rounds, so both see the same machine noise.
mlx-h2o decodes with mlx-lm's own `generate_step` (what a user runs), with its defaults: the fused
attention of its caches, the default CPU weights, and freed large buffers returned to the system as the
`mlx-h2o` command runs (--allocators). Prints each round's rows, then the medians with llama.cpp's full
cache as the reference of every row, and `uptime` before and after.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PREFILL_CHUNK = 512
# Options of an mlx-h2o path's processes, each marking its rows with "+OPTION" after the path's name:
GLIBC_OPTION = "glibc"  # the C allocator as it comes, not as the mlx-h2o command sets it (--allocators)
ISA_OPTIONS = ("avx2", "portable")  # an older kernel variant than this CPU's best (--isas, MLX_H2O_KERNEL_ISA)
DEFAULT_PEER_PYTHON = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "build", "venv-llamacpp", "bin", "python")


def with_kernel_variant(env: dict, isa: str) -> dict:
    """`env` for a process that runs kernel variant `isa`: "best" (the one its CPU runs) or one of
    ISA_OPTIONS, forced with MLX_H2O_KERNEL_ISA (read once per process)."""
    env = {k: v for k, v in env.items() if k != "MLX_H2O_KERNEL_ISA"}
    if isa != "best":
        env["MLX_H2O_KERNEL_ISA"] = isa
    return env


def prompt_tokens(context):
    import mlx_h2o

    mlx_h2o.use_openblas()  # before mlx.core loads
    from mlx_h2o.evaluation import load_corpus, token_samples
    from mlx_h2o.loading import load

    _, tokenizer = load()
    return token_samples(tokenizer, load_corpus(), 1, context, seed=1)[0][1]


def peak_rss_mib():
    """The worker's own peak resident memory (MiB). VmHWM, not getrusage: ru_maxrss also holds the peak
    of the process that exec'd it, and this benchmark's parent has loaded the model (~270-330 MiB), so
    every worker smaller than that reported the parent's peak. Rows before 2026-11-29 did; llama.cpp's
    most of all."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


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


def worker_ours(tokens, gen, spec, budget, allocator):
    import mlx_h2o  # isort: skip

    mlx_h2o.use_openblas()  # before mlx.core loads
    if allocator == "mmap":
        mlx_h2o.use_mmap_for_large_buffers()  # as the mlx-h2o command does (--allocators glibc: not)
        mlx_h2o.limit_mlx_buffer_cache()
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from mlx_h2o.evaluation.runner import parse_specs

    model, _ = mlx_h2o.load()  # the policies' caches attend with the fused kernel by default
    (policy,) = parse_specs([spec], [budget])
    cache = mlx_h2o.make_cache(model, policy.policy, **policy.options)
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
        r = worker_ours(tokens, args.gen, args.worker.split(":", 2)[2], args.budget, args.allocator)
    r["peak_rss_mib"] = peak_rss_mib()
    print(json.dumps(r))


def cpu_busy(seconds=1.0) -> float:
    """Cores kept busy by the machine over `seconds` (from /proc/stat; this process sleeps meanwhile)."""

    def sample():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]  # total, idle + iowait

    (t0, i0), _, (t1, i1) = sample(), time.sleep(seconds), sample()
    return (os.cpu_count() or 1) * (1 - (i1 - i0) / max(1, t1 - t0))


def add_quiet_arguments(parser, before: str = "the first measurement") -> None:
    """The options of wait_quiet's check, on an argparse parser."""
    parser.add_argument("--max-load", type=float, default=1.0, help=f"1-minute load required before {before}")
    parser.add_argument("--max-busy", type=float, default=0.3, help="cores other work may keep busy before a measurement")
    parser.add_argument("--wait", type=int, default=300, help="seconds to wait for a quiet machine")
    parser.add_argument("--allow-load", action="store_true", help="warn instead of refusing on a busy machine")


def wait_quiet(args, first=False):
    """(busy cores, 1-minute load) once the machine is quiet, or after waiting --wait seconds."""
    deadline = time.monotonic() + args.wait
    while True:
        busy, load = cpu_busy(), os.getloadavg()[0]
        quiet = busy <= args.max_busy and (not first or load < args.max_load)
        if quiet or time.monotonic() > deadline:
            break
        print(f"  waiting for a quiet machine: {busy:.2f} cores busy, load {load:.2f}", flush=True)
        time.sleep(5)
    if not quiet:
        msg = f"the machine is not quiet ({busy:.2f} cores busy, 1-minute load {load:.2f}) after {args.wait} s"
        if not args.allow_load:
            sys.exit(msg + ": stop other work, or pass --allow-load to measure anyway (the ratios will not hold)")
        print("WARNING: " + msg + "; measuring anyway (--allow-load)", flush=True)
    return busy, load


def measure(engine, tokens, args):
    """One fresh process: {'prefill_tok_s', 'decode_tok_s', 'peak_rss_mib', 'tokens'}."""
    env = {**os.environ, "MLX_H2O_NUM_THREADS": str(args.threads), "OPENBLAS_NUM_THREADS": str(args.threads),
           "OMP_NUM_THREADS": str(args.threads)}
    if engine == "peer":
        python, allocator = args.peer_python, []
    else:
        name, *options = engine.split(":")[1].split("+")
        python = args.ours[name]
        allocator = ["--allocator", "glibc" if GLIBC_OPTION in options else "mmap"]
        env = with_kernel_variant(env, next((o for o in options if o in ISA_OPTIONS), "best"))
        if os.path.abspath(python) != sys.executable:  # another venv: its own installed mlx_h2o
            env.pop("PYTHONPATH", None)
    cmd = [python, os.path.abspath(__file__), "--worker", engine, "--gen", str(args.gen), "--threads", str(args.threads),
           "--model-path", args.model_path, "--budget", str(args.budget), *allocator]
    r = subprocess.run(cmd, input=json.dumps(tokens), capture_output=True, text=True, env=env)
    if r.returncode != 0:
        how = f"killed by signal {-r.returncode}" if r.returncode < 0 else f"exit status {r.returncode}"
        hint = " (llama.cpp: see this file's docstring on AMX)" if engine == "peer" and r.returncode < 0 else ""
        raise RuntimeError(f"{engine} worker failed, {how}{hint}:\n{r.stderr[-3000:]}")
    res = json.loads(r.stdout.strip().splitlines()[-1])
    res["prefill_tok_s"] = len(tokens) / res["prefill_s"]
    res["decode_tok_s"] = (args.gen - 1) / res["decode_s"]
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", nargs="+", type=int, default=[512, 2048, 8192])
    ap.add_argument("--gen", type=int, default=64, help="tokens generated after the prompt")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--caches", nargs="+", default=["full", "h2o"], metavar="SPEC",
                    help="mlx-h2o's caches, as policy specs (NAME[:KEY=VALUE,...]; a bounded one without a budget "
                         "gets max_kv_size=--budget), e.g. full:kv_dtype=float16")
    ap.add_argument("--budget", type=int, default=512, help="max_kv_size M of mlx-h2o's h2o cache")
    ap.add_argument("--allocators", nargs="+", choices=["mmap", "glibc"], default=["mmap"],
                    help="mlx-h2o's processes with freed large buffers returned to the system, as the mlx-h2o command "
                         "runs (mmap: mlx_h2o.use_mmap_for_large_buffers() and limit_mlx_buffer_cache()) and/or with the "
                         "allocators as they come (glibc: rows marked +glibc)")
    ap.add_argument("--isas", nargs="+", choices=("best",) + ISA_OPTIONS, default=["best"],
                    help="mlx-h2o's kernel variants: best (the one this CPU runs) and/or an older one forced with "
                         "MLX_H2O_KERNEL_ISA (rows marked +avx2, +portable): an A/B of the kernels in one run")
    ap.add_argument("--peer-python", default=DEFAULT_PEER_PYTHON, help="a python with llama-cpp-python installed")
    ap.add_argument("--ours", nargs="+", default=[f"stock={sys.executable}"], metavar="NAME=PYTHON",
                    help="mlx-h2o paths to measure, each a name and the python that runs it")
    add_quiet_arguments(ap, "the first round")
    ap.add_argument("--quick", action="store_true", help="512 context, 32 tokens, 1 round")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model-path", help=argparse.SUPPRESS)
    ap.add_argument("--allocator", default="mmap", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return run_worker(args)
    if args.quick:
        args.contexts, args.gen, args.rounds = [512], 32, 1
    try:
        from mlx_h2o.evaluation.runner import parse_specs

        labels = {spec: parse_specs([spec], [args.budget])[0].label for spec in args.caches}
    except ValueError as e:
        ap.error(f"--caches: {e}")
    if any("=" not in o or "+" in o.split("=")[0] or ":" in o.split("=")[0] for o in args.ours):
        ap.error("--ours takes NAME=PYTHON pairs (no '+' or ':' in NAME), e.g. fork=build/venv-fork/bin/python")
    args.ours = dict(o.split("=", 1) for o in args.ours)
    missing = [p for p in args.ours.values() if not os.path.exists(p)]
    if missing:
        ap.error(f"no python at {', '.join(missing)}")
    from mlx_h2o.loading import default_model_path

    args.model_path = str(default_model_path())
    if not os.path.exists(args.peer_python):
        sys.exit(f"no llama-cpp-python at {args.peer_python}; see this file's docstring, or pass --peer-python")
    print(f"uptime before: {os.popen('uptime').read().strip()}", flush=True)
    wait_quiet(args, first=True)
    engines = ["peer"] + [f"ours:{path}{'+' + GLIBC_OPTION if a == 'glibc' else ''}{'' if isa == 'best' else '+' + isa}:{c}"
                          for path in args.ours for a in args.allocators for isa in args.isas for c in args.caches]
    runs = {}
    worst = (0.0, 0.0)
    for ctx in args.contexts:
        tokens = prompt_tokens(ctx)
        for rnd in range(args.rounds):
            order = engines if rnd % 2 == 0 else engines[::-1]
            for engine in order:
                busy, load = wait_quiet(args)
                worst = max(worst[0], busy), max(worst[1], load)
                r = measure(engine, tokens, args)
                runs.setdefault((ctx, engine), []).append(r)
                print(f"ctx {ctx} round {rnd} {engine:34s} prefill {r['prefill_tok_s']:7.1f} tok/s  decode "
                      f"{r['decode_tok_s']:6.1f} tok/s  peak RSS {r['peak_rss_mib']:6.0f} MiB  (before it: {busy:.2f} "
                      f"cores busy, load {load:.2f})", flush=True)
    print(f"uptime after: {os.popen('uptime').read().strip()}")
    print(f"before every measurement: at most {worst[0]:.2f} cores busy with other work, 1-minute load at most "
          f"{worst[1]:.2f} (the load includes the previous measurement's own decay)\n")
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("prefill_tok_s", "decode_tok_s", "peak_rss_mib")}
           for k, v in runs.items()}
    header = ["context", "engine", "path", "cache", "prefill tok/s", "decode tok/s", "decode min-max", "peak RSS MiB",
              "prefill vs llama.cpp", "decode vs llama.cpp", "RSS vs llama.cpp"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for ctx in args.contexts:
        peer = med[(ctx, "peer")]
        for engine in engines:
            m = med[(ctx, engine)]
            name, path, cache = ("llama.cpp", "", "full") if engine == "peer" else (
                "mlx-h2o", engine.split(":")[1], labels[engine.split(":", 2)[2]])
            decode = [r["decode_tok_s"] for r in runs[(ctx, engine)]]
            print(f"| {ctx} | {name} | {path} | {cache} | {m['prefill_tok_s']:.1f} | {m['decode_tok_s']:.1f} | "
                  f"{min(decode):.1f}-{max(decode):.1f} | {m['peak_rss_mib']:.0f} | "
                  f"{m['prefill_tok_s'] / peer['prefill_tok_s']:.2f}x | {m['decode_tok_s'] / peer['decode_tok_s']:.2f}x | "
                  f"{m['peak_rss_mib'] / peer['peak_rss_mib']:.2f}x |")
    # Same greedy continuation? (different kernels round differently; a report, not a check)
    for ctx in args.contexts:
        a, b = runs[(ctx, "peer")][0]["tokens"], runs[(ctx, engines[1])][0]["tokens"]
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        print(f"ctx {ctx}: greedy tokens agree with llama.cpp for the first {same} of {len(a)}")


if __name__ == "__main__":
    main()
