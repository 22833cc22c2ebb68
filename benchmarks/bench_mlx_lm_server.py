"""The patched mlx_lm.server under load, on 127.0.0.1: throughput, a long prompt beside short ones,
chat turns, a shared system prompt, and RSS over many requests.

    python benchmarks/bench_mlx_lm_server.py                      # every part (about 19 min here)
    python benchmarks/bench_mlx_lm_server.py throughput turns     # some parts
    python benchmarks/bench_mlx_lm_server.py --model DIR --out results/server

Parts:
  throughput  1, 4 and 8 concurrent clients, each sending --rounds streamed chat completions one
              after another (distinct --prompt-tokens prompts): requests/s, TTFT p50/p99 and
              generated tokens/s, h2o against the full cache (both servers up, runs alternating).
  interleave  4 clients sending short requests, alone and beside one --long-tokens prompt: the short
              requests' latency p50/p99 with and without the long prompt, for each --schedules
              STEP:SHARE (--prefill-step-size, --prefill-time-share); 2048:1 is mlx-lm's step and share.
  turns       a chat of three turns over ~--history-tokens of text: each turn's TTFT and the tokens
              the prompt cache supplied (h2o and full).
  sharing     8 concurrent requests behind one shared --system-tokens system prompt (after one
              request has left its snapshot in the prompt cache) against 8 with distinct system
              prompts: TTFT and server RSS.
  held        in this process, through the server's prompt-cache store and BatchGenerator: the KV
              memory 8 concurrent requests behind one --system-tokens system prompt add to its
              snapshot's, as copies of the snapshot (how the server serves them: rows shared, copy
              on write) against independent copies; h2o (M = 2048 and --max-kv-size) and full.
  batched     in this process: decode throughput of 4 and 8 sequences through BatchGenerator, the
              full policy's batch (SharedRowsBatch: a sequence's rows in its own cache, a shared
              prefix held once) against mlx-lm's BatchKVCache (one padded array), for requests
              forked from a --system-tokens snapshot and for fresh prompts; runs alternating.
  rss         --requests mixed requests from 4 clients (short, long, follow-up turns, malformed
              bodies, over-long prompts): server RSS every 50 requests, a PNG of the curve.
  steps       in this process, no server: prefill speed of a 2,048-token prompt in steps of
              2048, 256 and 128 tokens (the price of --prefill-step-size), full and h2o.
  budget      in this process: the most each policy's caches hold through a chunked prefill and a
              few decode steps, against what --kv-budget-bytes reserves for the request.

Times are client-side. Nothing else should run while this does: it prints the load average with
every table, and waits for a quiet machine first (bench_peer's check: --max-load, --max-busy,
--wait; it refuses after --wait seconds unless --allow-load is given).
"""

import argparse
import concurrent.futures
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

from bench_peer import add_quiet_arguments, wait_quiet

from mlx_h2o import serving

PARTS = ("throughput", "interleave", "turns", "sharing", "held", "batched", "rss", "steps", "budget")


def load() -> str:
    return "load %.2f %.2f %.2f" % os.getloadavg()


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


def check(results):
    failed = [r for r in results if r.status != 200 or not r.text.strip()]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(results)} requests failed: {[(r.status, r.error) for r in failed][:3]}")
    return results


def closed_loop(port, clients, messages_of, max_tokens, timeout):
    """`clients` threads, client i sending messages_of(i, 0), messages_of(i, 1), ... until None;
    returns (all completions, wall seconds)."""

    def client(i):
        done, k = [], 0
        while (messages := messages_of(i, k)) is not None:
            done.append(serving.chat(port, messages, max_tokens, True, timeout))
            k += 1
        return done

    tic = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        results = [c for f in [pool.submit(client, i) for i in range(clients)] for c in f.result(timeout=timeout * 10)]
    return check(results), time.perf_counter() - tic


def user(text):
    return [{"role": "user", "content": text}]


def part_throughput(args, model_dir, tokenizer, policies):
    prompts = {}

    def prompt(seed):
        if seed not in prompts:
            prompts[seed] = serving.long_prompt(tokenizer, args.prompt_tokens, seed=seed)
        return prompts[seed]

    rows = []
    with serving.serve(model_dir, policies["h2o"]) as h2o, serving.serve(model_dir, policies["full"]) as full:
        servers = {"h2o": h2o, "full": full}
        for s in servers.values():
            serving.chat(s.port, user("Hello."), 4, True, args.timeout)
        for level, clients in enumerate((1, 4, 8)):
            order = ["h2o", "full"] if level % 2 == 0 else ["full", "h2o"]
            for name in order:
                # Distinct prompts everywhere: nothing comes from the prompt cache.
                base = 1000 * level + (0 if name == "h2o" else 500)
                results, wall = closed_loop(
                    servers[name].port, clients,
                    lambda i, k: user(prompt(base + 10 * i + k)) if k < args.rounds else None,
                    args.max_tokens, args.timeout)
                ttfts = [r.ttft for r in results]
                tokens = sum(r.usage["completion_tokens"] for r in results)
                rows.append({"policy": name, "clients": clients, "requests": len(results), "wall_s": wall,
                             "req_s": len(results) / wall, "ttft_p50": statistics.median(ttfts),
                             "ttft_p99": percentile(ttfts, 99), "tok_s": tokens / wall,
                             "rss_mib": servers[name].rss_mib(), "load": load()})
                print(f"  throughput {name} x{clients}: {rows[-1]['req_s']:.3f} req/s ({load()})", flush=True)
    print(f"\n### Throughput: {args.prompt_tokens}-token prompts, {args.max_tokens} new tokens, each client "
          f"{args.rounds} requests in a row; h2o {policies['h2o'][1:]}")
    print("| clients | policy | requests/s | TTFT p50 (s) | TTFT p99 (s) | tokens/s | RSS (MiB) | load |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in sorted(rows, key=lambda r: (r["clients"], r["policy"] != "full")):
        print(f"| {r['clients']} | {r['policy']} | {r['req_s']:.3f} | {r['ttft_p50']:.2f} | {r['ttft_p99']:.2f} | "
              f"{r['tok_s']:.1f} | {r['rss_mib']:.0f} | {r['load']} |")
    return rows


def part_interleave(args, model_dir, tokenizer, policies):
    long_text = serving.long_prompt(tokenizer, args.long_tokens, seed=7)
    configs = {}
    for schedule in args.schedules:
        step, share = schedule.split(":")
        configs[f"step {step}, share {share}"] = ["--prefill-step-size", step, "--prefill-time-share", share]
    short = [user(f"Question {i}: name a {w} and say why in a sentence.")
             for i, w in enumerate(["colour", "fruit", "river", "tree", "bird", "stone", "tool", "song"] * 4)]
    rows = []
    for config, extra in configs.items():
        with serving.serve(model_dir, policies["h2o"] + extra) as server:
            serving.chat(server.port, user("Hello."), 4, True, args.timeout)
            for phase in ("alone", "beside the long prompt"):
                long_future = None
                with concurrent.futures.ThreadPoolExecutor(1) as pool:
                    if phase != "alone":
                        long_future = pool.submit(serving.chat, server.port, user(long_text), 8, True, args.timeout)
                        time.sleep(0.5)  # the long prompt is being processed when the short ones arrive
                    results, wall = closed_loop(server.port, 4, lambda i, k: short[4 * k + i] if k < args.rounds else None,
                                                args.short_tokens, args.timeout)
                    long_result = check([long_future.result(timeout=args.timeout)])[0] if long_future else None
                latencies = [r.seconds for r in results]
                rows.append({"config": config, "phase": phase, "p50": statistics.median(latencies),
                             "p99": percentile(latencies, 99), "requests": len(results),
                             "long_ttft": long_result.ttft if long_result else None, "load": load()})
                print(f"  interleave {config} {phase}: p99 {rows[-1]['p99']:.2f} s ({load()})", flush=True)
    print(f"\n### A {args.long_tokens}-token prompt beside 4 clients of short requests ({args.short_tokens} new "
          f"tokens, {args.rounds} each); h2o {policies['h2o'][1:]}")
    print("| scheduling | short requests | latency p50 (s) | latency p99 (s) | p99 / alone | long prompt TTFT (s) | load |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        alone = next(x for x in rows if x["config"] == r["config"] and x["phase"] == "alone")
        long_ttft = f"{r['long_ttft']:.1f}" if r["long_ttft"] is not None else "—"
        print(f"| {r['config']} | {r['phase']} | {r['p50']:.2f} | {r['p99']:.2f} | {r['p99'] / alone['p99']:.2f}x | "
              f"{long_ttft} | {r['load']} |")
    return rows


def part_turns(args, model_dir, tokenizer, policies):
    rows = []
    for name in ("h2o", "full"):
        with serving.serve(model_dir, policies[name]) as server:
            serving.chat(server.port, user("Hello."), 4, True, args.timeout)
            for conversation in range(2):
                messages = user(serving.long_prompt(tokenizer, args.history_tokens, seed=40 + conversation))
                follow_ups = ["Say that again in five words.", "Now in three words."]
                for turn in range(3):
                    reply = check([serving.chat(server.port, messages, 16, True, args.timeout)])[0]
                    rows.append({"policy": name, "conversation": conversation, "turn": turn + 1, "ttft": reply.ttft,
                                 "prompt_tokens": reply.usage["prompt_tokens"],
                                 "cached_tokens": (reply.usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                                 "load": load()})
                    if turn < 2:
                        messages = messages + [{"role": "assistant", "content": reply.text},
                                               {"role": "user", "content": follow_ups[turn]}]
    print(f"\n### Chat turns over ~{args.history_tokens} tokens of history (two conversations, median TTFT)")
    print("| policy | turn | prompt tokens | from the prompt cache | TTFT (s) | TTFT / turn 1 | load |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in ("h2o", "full"):
        first = statistics.median(r["ttft"] for r in rows if r["policy"] == name and r["turn"] == 1)
        for turn in (1, 2, 3):
            sel = [r for r in rows if r["policy"] == name and r["turn"] == turn]
            ttft = statistics.median(r["ttft"] for r in sel)
            print(f"| {name} | {turn} | {sel[0]['prompt_tokens']} | {sel[0]['cached_tokens']} | {ttft:.2f} | "
                  f"{ttft / first:.3f} | {sel[-1]['load']} |")
    return rows


def part_sharing(args, model_dir, tokenizer, policies):
    questions = [f"In one sentence, what does section {i + 1} say?" for i in range(8)]
    rows = []
    for name in ("h2o", "full"):
        for shared in (True, False):
            with serving.serve(model_dir, policies[name]) as server:
                system = [serving.long_prompt(tokenizer, args.system_tokens, seed=60 + (0 if shared else i))
                          for i in range(8)]
                if shared:  # one request leaves the system prompt's snapshot in the prompt cache
                    check([serving.chat(server.port, [{"role": "system", "content": system[0]}] + user("Hello."), 4,
                                        True, args.timeout)])
                else:
                    serving.chat(server.port, user("Hello."), 4, True, args.timeout)
                rss_before = server.rss_mib()
                results, wall = closed_loop(
                    server.port, 8,
                    lambda i, k: [{"role": "system", "content": system[i]}] + user(questions[i]) if k == 0 else None,
                    8, args.timeout)
                ttfts = [r.ttft for r in results]
                rows.append({"policy": name, "shared": shared, "ttft_p50": statistics.median(ttfts),
                             "ttft_max": max(ttfts), "wall_s": wall,
                             "cached_tokens": statistics.median(
                                 (r.usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for r in results),
                             "rss_before": rss_before, "rss_after": server.rss_mib(), "load": load()})
                print(f"  sharing {name} shared={shared}: TTFT p50 {rows[-1]['ttft_p50']:.2f} s ({load()})", flush=True)
    print(f"\n### 8 concurrent requests behind a {args.system_tokens}-token system prompt")
    print("| policy | system prompt | cached tokens (median) | TTFT p50 (s) | TTFT max (s) | all 8 done (s) | "
          "RSS before → after (MiB) | load |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['policy']} | {'shared' if r['shared'] else 'distinct'} | {r['cached_tokens']:.0f} | "
              f"{r['ttft_p50']:.2f} | {r['ttft_max']:.2f} | {r['wall_s']:.1f} | "
              f"{r['rss_before']:.0f} → {r['rss_after']:.0f} | {r['load']} |")
    return rows


def part_rss(args, model_dir, tokenizer, policies):
    """Mixed traffic; the server's RSS after every 50 requests."""
    out = Path(args.out)
    medium = [serving.long_prompt(tokenizer, 300, seed=80 + i) for i in range(7)]
    with open(os.path.join(model_dir, "config.json")) as f:
        over_long = " ".join(["hello"] * (2 * json.load(f)["max_position_embeddings"]))
    curve, statuses, lock = [], {}, threading.Lock()
    counter = iter(range(args.requests))

    def one(n):
        kind = n % 10
        if kind == 7:  # a malformed body
            status, _ = serving.request(port, "POST", "/v1/chat/completions", raw=b'{"messages": [', timeout=args.timeout)
        elif kind == 9:  # over the model's context
            status = serving.chat(port, user(over_long), 8, False, args.timeout).status
        elif kind in (3, 6):  # a follow-up turn of a chat over a medium prompt
            first = user(medium[n % 7])
            reply = serving.chat(port, first, 8, True, args.timeout)
            status = serving.chat(port, first + [{"role": "assistant", "content": reply.text},
                                                 {"role": "user", "content": f"And {n}?"}], 8, True, args.timeout).status
        elif kind in (1, 4, 8):
            status = serving.chat(port, user(medium[n % 7] + f" ({n})"), 8, True, args.timeout).status
        else:
            status = serving.chat(port, user(f"Say a word about the number {n}."), 8, True, args.timeout).status
        return status

    def client():
        for n in counter:
            status = one(n)
            with lock:
                statuses[status] = statuses.get(status, 0) + 1
                done = sum(statuses.values())
                if done % 50 == 0:
                    curve.append((done, server.rss_mib()))
                    print(f"  rss after {done} requests: {curve[-1][1]:.0f} MiB ({load()})", flush=True)

    with serving.serve(model_dir, policies["h2o"]) as server:
        port = server.port
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            for f in [pool.submit(client) for _ in range(4)]:
                f.result(timeout=args.timeout * args.requests)
    ratio = curve[-1][1] / curve[0][1]
    print(f"\n### Server RSS over {args.requests} mixed requests (4 clients; h2o {policies['h2o'][1:]}); "
          f"statuses {statuses}")
    print("| requests | " + " | ".join(str(n) for n, _ in curve) + " |")
    print("| --- | " + " | ".join("---" for _ in curve) + " |")
    print("| RSS (MiB) | " + " | ".join(f"{r:.0f}" for _, r in curve) + " |")
    print(f"RSS after {curve[-1][0]} / after {curve[0][0]}: {ratio:.3f}x ({load()})")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.2))
        ax.plot([n for n, _ in curve], [r for _, r in curve], marker="o")
        ax.set_xlabel("requests served")
        ax.set_ylabel("server RSS (MiB)")
        ax.set_ylim(0, max(r for _, r in curve) * 1.15)
        ax.set_title("mlx_lm.server, h2o, mixed requests")
        fig.tight_layout()
        fig.savefig(out / "server_rss.png", dpi=120)
        print(f"plot: {out / 'server_rss.png'}")
    except ImportError:
        print("(no matplotlib: no plot)")
    return {"curve": curve, "statuses": statuses, "ratio": ratio}


def licence_tokens(tokenizer, n):
    with open("/usr/share/common-licenses/GPL-3", encoding="utf-8") as f:
        return tokenizer.encode(f.read())[:n]


def feed(model, x, cache, step, decode_steps=0):
    """x through the caches in prompt steps of `step` tokens, then `decode_steps` single tokens; the
    most bytes the caches held after any step."""
    import mlx.core as mx

    held = 0
    chunks = [x[:, i:i + step] for i in range(0, x.shape[1], step)] + [x[:, -1:]] * decode_steps
    for chunk in chunks:
        model(chunk, cache=cache)
        mx.eval([c.state for c in cache])
        held = max(held, sum(c.nbytes for c in cache))
    return held


def part_steps(args, model_dir, tokenizer, policies):
    import mlx.core as mx
    from mlx_lm import load as load_model
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = load_model(model_dir)
    x = mx.array(licence_tokens(tokenizer, 2048))[None]
    cache_options = {"full": {}, "h2o": {"max_kv_size": args.max_kv_size}}

    def prefill(policy, step):
        cache = make_prompt_cache(model, policy=policy, **cache_options[policy])
        tic = time.perf_counter()
        feed(model, x, cache, step)
        return x.shape[1] / (time.perf_counter() - tic)

    steps, rows = (2048, 256, 128), {}
    for policy in cache_options:
        prefill(policy, 256)  # warm-up
        runs = {step: [] for step in steps}
        for _ in range(3):  # steps alternate within each round
            for step in steps:
                runs[step].append(prefill(policy, step))
        rows[policy] = {step: statistics.median(v) for step, v in runs.items()}
        print(f"  steps {policy}: {rows[policy]} ({load()})", flush=True)
    print(f"\n### Prefill of a {x.shape[1]}-token prompt by step size (median of 3, tok/s; {load()})")
    print("| cache | " + " | ".join(f"step {s}" for s in steps) + " |")
    print("| --- |" + " --- |" * len(steps))
    for policy, row in rows.items():
        print(f"| {policy} | " + " | ".join(
            f"{row[s]:.0f}" + ("" if s == steps[0] else f" ({row[s] / row[steps[0]] - 1:+.0%})") for s in steps) + " |")
    return rows


def part_budget(args, model_dir, tokenizer, policies):
    import mlx.core as mx
    from mlx_lm import load as load_model
    from mlx_lm import server
    from mlx_lm.models import cache_policies
    from mlx_lm.models.cache import make_prompt_cache

    if not hasattr(server, "KVBudget"):
        raise SystemExit("budget: needs the patched mlx-lm (patch 0008, --kv-budget-bytes)")
    model, _ = load_model(model_dir)
    budget = server.KVBudget(1 << 40, wait=1.0)
    specs = [("full", {}), ("rotating", {"max_kv_size": "256"}), ("h2o", {"max_kv_size": "256"}),
             ("h2o", {"max_kv_size": "64"}), ("h2o", {"max_kv_bytes": "8MB"}), ("quantized", {}), ("rotated", {})]
    rows = []
    for policy, raw in specs:
        options = cache_policies.get_policy(policy).parse_options(raw)
        for n in (100, 700, 2000):
            for step in (128, 2048):
                cache = make_prompt_cache(model, policy=policy, **options)
                held = feed(model, mx.array(licence_tokens(tokenizer, n))[None], cache, step, decode_steps=20)
                need = budget.request_bytes(model, n + 20, options, step)
                rows.append({"policy": policy, "options": raw, "prompt": n, "step": step, "held": held, "reserved": need})
    print("\n### What each request's caches hold against what --kv-budget-bytes reserves (prompt + 20 tokens)")
    print("| policy | options | prompt | step | held (MB) | reserved (MB) | held / reserved |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['policy']} | {r['options'] or '—'} | {r['prompt']} | {r['step']} | {r['held'] / 1e6:.1f} | "
              f"{r['reserved'] / 1e6:.1f} | {r['held'] / r['reserved']:.2f} |")
    over = [r for r in rows if r["held"] > r["reserved"]]
    print("every reservation holds" if not over else f"OVER in {len(over)} rows: {over}")
    return rows


def part_held(args, model_dir, tokenizer, policies):
    import gc

    import mlx.core as mx
    from mlx_lm import load as load_model
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.models.cache import LRUPromptCache, load_prompt_cache, make_prompt_cache, save_prompt_cache

    model, _ = load_model(model_dir)
    system = licence_tokens(tokenizer, args.system_tokens)
    questions = [tokenizer.encode(f" In one sentence, what does section {i + 1} say?") for i in range(8)]
    specs = [("h2o", {"max_kv_size": 2048}), ("h2o", {"max_kv_size": args.max_kv_size}), ("full", {})]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for policy, options in specs:
            snapshot = make_prompt_cache(model, policy=policy, **options)
            feed(model, mx.array(system)[None], snapshot, 128)
            prefix = sum(c.nbytes for c in snapshot)
            path = os.path.join(tmp, "system.safetensors")
            save_prompt_cache(path, snapshot)
            store = LRUPromptCache()  # the server's prompt-cache store, holding the system prompt's snapshot
            store.insert_cache("model", system, snapshot, cache_type="system")
            in_store = snapshot  # (no memory of its own: the store's entry) for its size as the requests found it
            del snapshot
            for mode in ("copies of the snapshot", "independent copies"):
                gc.collect()
                mx.clear_cache()
                base = mx.get_active_memory()
                if mode == "copies of the snapshot":  # what the server does: fetch_nearest_cache deep-copies
                    caches, prompts = map(list, zip(*(store.fetch_nearest_cache("model", system + q) for q in questions)))
                else:  # each request its own rows (as before copy-on-write storage)
                    caches, prompts = [load_prompt_cache(path) for _ in questions], questions
                gen = BatchGenerator(model, stop_tokens=[], prefill_step_size=128)
                gen.insert(prompts, [args.max_tokens] * len(prompts), caches=caches)
                del caches
                peak, left = 0, len(prompts)
                while left:
                    left -= sum(r.finish_reason is not None for r in gen.next_generated())
                    peak = max(peak, mx.get_active_memory() - base)
                gen.close()
                del gen
                if mode == "copies of the snapshot":  # the first copy compacts a snapshot a prefill left above M (h2o)
                    prefix = sum(c.nbytes for c in in_store)
                rows.append({"policy": policy, "options": options, "mode": mode, "prefix": prefix, "added": peak})
                print(f"  held {policy} {options} {mode}: {peak / 1e6:.1f} MB added ({load()})", flush=True)
    print(f"\n### 8 concurrent requests behind one {args.system_tokens}-token system prompt: KV memory they add to "
          f"the snapshot's (peak active MLX memory, {args.max_tokens} new tokens each)")
    print("| policy | options | the snapshot (MB) | requests' caches | added by 8 requests (MB) | in snapshots |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['policy']} | {r['options'] or '—'} | {r['prefix'] / 1e6:.1f} | {r['mode']} | {r['added'] / 1e6:.1f} | "
              f"{r['added'] / r['prefix']:.2f} |")
    return rows


def part_batched(args, model_dir, tokenizer, policies):
    import copy

    import mlx.core as mx
    from mlx_lm import load as load_model
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.models import cache as lm_cache

    import mlx_h2o

    model, _ = load_model(model_dir)
    system = licence_tokens(tokenizer, args.system_tokens)
    makers = {"mlx-lm BatchKVCache": lambda: lm_cache.make_prompt_cache(model),  # mlx-lm's own, no policy
              "full (SharedRowsBatch)": lambda: mlx_h2o.make_cache(model, "full")}
    snapshots = {}
    for name, make in makers.items():
        snapshots[name] = make()
        feed(model, mx.array(system)[None], snapshots[name], 256)

    def decode_rate(name, n, forked):
        questions = [tokenizer.encode(f" In one sentence, what does section {i + 1} say?") for i in range(n)]
        if forked:  # what the server does with a cached system prompt: a deep copy per request
            caches, prompts = [copy.deepcopy(snapshots[name]) for _ in questions], questions
        else:  # no shared prefix: prompts of different lengths
            caches, prompts = [makers[name]() for _ in questions], [system[: 700 + 10 * i] + q for i, q in enumerate(questions)]
        gen = BatchGenerator(model, stop_tokens=[], prefill_step_size=512)
        gen.insert(prompts, [args.max_tokens] * n, caches=caches)
        start = tokens = left = None
        while left is None or left:
            responses = gen.next_generated()
            if start is None and responses:  # every prompt processed: decoding from here
                start, tokens, left = time.perf_counter(), 0, n
                continue
            tokens += len(responses)
            left -= sum(r.finish_reason is not None for r in responses)
        rate = tokens / (time.perf_counter() - start)
        gen.close()
        return rate

    rows, rounds = [], 3
    for n in (4, 8):
        for forked in (True, False):
            rates = {name: [] for name in makers}
            for _ in range(rounds):
                for name in makers:
                    rates[name].append(decode_rate(name, n, forked))
            for name, r in rates.items():
                rows.append({"sequences": n, "forked": forked, "cache": name, "rates": r})
            print(f"  batched {n} {'forked' if forked else 'fresh'}: " + ", ".join(
                f"{name} {statistics.median(r):.1f} tok/s" for name, r in rates.items()) + f" ({load()})", flush=True)
    print(f"\n### Batched decode, tok/s of all sequences together (median of {rounds}, min-max; {args.max_tokens} new "
          f"tokens each; forked: behind one {args.system_tokens}-token snapshot; fresh: 700-780-token prompts)")
    print("| sequences | prompts | mlx-lm BatchKVCache | full (SharedRowsBatch) | ratio |")
    print("| --- | --- | --- | --- | --- |")
    for i in range(0, len(rows), 2):
        a, b = rows[i], rows[i + 1]
        ma, mb = statistics.median(a["rates"]), statistics.median(b["rates"])
        print(f"| {a['sequences']} | {'forked' if a['forked'] else 'fresh'} | {ma:.1f} ({min(a['rates']):.1f}-{max(a['rates']):.1f}) "
              f"| {mb:.1f} ({min(b['rates']):.1f}-{max(b['rates']):.1f}) | {mb / ma:.2f} |")
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("parts", nargs="*", help=f"any of {', '.join(PARTS)} (default: all)")
    p.add_argument("--model", default=None, help="an mlx-lm model directory (default: convert the embedded model)")
    p.add_argument("--max-kv-size", type=int, default=256, help="the h2o budget M")
    p.add_argument("--prompt-tokens", type=int, default=768, help="throughput: prompt length")
    p.add_argument("--max-tokens", type=int, default=32, help="throughput, held, batched: new tokens per request")
    p.add_argument("--rounds", type=int, default=2, help="requests each client sends in a row")
    p.add_argument("--long-tokens", type=int, default=6000, help="interleave: the long prompt")
    p.add_argument("--schedules", nargs="+", default=["2048:1", "128:0.25"],
                   help="interleave: prompt step and prefill time share, STEP:SHARE each")
    p.add_argument("--short-tokens", type=int, default=24, help="interleave: new tokens of a short request")
    p.add_argument("--history-tokens", type=int, default=2000, help="turns: the first turn's length")
    p.add_argument("--system-tokens", type=int, default=1000, help="sharing, held, batched: the system prompt's length")
    p.add_argument("--requests", type=int, default=1000, help="rss: how many requests")
    p.add_argument("--timeout", type=float, default=600.0, help="deadline of each request, seconds")
    p.add_argument("--out", default="results/server", help="JSON and PNG go here")
    add_quiet_arguments(p, "the first part")
    args = p.parse_args(argv)
    parts = args.parts or list(PARTS)
    if set(parts) - set(PARTS):
        p.error(f"unknown part(s) {sorted(set(parts) - set(PARTS))}: choose from {', '.join(PARTS)}")
    wait_quiet(args, first=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    policies = {"h2o": ["--kv-policy", "h2o", "--kv-option", f"max_kv_size={args.max_kv_size}"],
                "full": ["--kv-policy", "full"]}
    from importlib.metadata import version

    print(f"bench_mlx_lm_server: {', '.join(parts)}; mlx {version('mlx')}, mlx_lm {version('mlx_lm')}; {load()}",
          flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from mlx_h2o.convert import convert

            print("converting the embedded model ...", flush=True)
            model_dir = str(convert(Path(tmp) / "model"))
        from mlx_lm.utils import load_tokenizer

        tokenizer = load_tokenizer(Path(model_dir))
        results = {}
        for part in parts:
            tic = time.perf_counter()
            results[part] = globals()[f"part_{part}"](args, model_dir, tokenizer, policies)
            print(f"({part}: {time.perf_counter() - tic:.0f} s)", flush=True)
            with open(out / f"{part}.json", "w") as f:
                json.dump({"args": vars(args), "rows": results[part]}, f, indent=1)


if __name__ == "__main__":
    main()
