"""mlx_lm.server (patched wheel) with --kv-policy h2o vs --kv-policy full: requests/s and
time-to-first-token for N concurrent streamed chat completions with long prompts, on 127.0.0.1.

    mlx-h2o convert --out /tmp/smollm2      # once (or let the benchmark convert into a temp dir)
    python benchmarks/bench_mlx_lm_server.py --model /tmp/smollm2 --requests 8 --prompt-tokens 1500

Policies alternate within each repeat (h2o, full, then full, h2o, ...) so that the machine's load
hits both alike; the ratios h2o/full are what to read, next to the `uptime` load printed with them.
Every server is started for its run and stopped after it; each request has a deadline.
"""

import argparse
import concurrent.futures
import os
import statistics
import tempfile
import time
from pathlib import Path

from mlx_h2o import serving


def run_policy(model_dir, policy_args, prompts, max_tokens, timeout):
    with serving.serve(model_dir, policy_args) as server:
        serving.chat(server.port, [{"role": "user", "content": "Hello."}], 8, True, timeout)  # warm-up
        tic = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            futures = [pool.submit(serving.chat, server.port, [{"role": "user", "content": p}], max_tokens, True, timeout)
                       for p in prompts]
            results = [f.result(timeout=timeout + 60) for f in futures]
        wall = time.perf_counter() - tic
        rss = server.rss_mib()
        batched = "one at a time" not in server.log()
    failed = [r for r in results if r.status != 200 or not r.text.strip()]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {[(r.status, r.error) for r in failed]}")
    ttfts = [r.ttft for r in results]
    return {"req_s": len(results) / wall, "ttft_median": statistics.median(ttfts), "ttft_max": max(ttfts), "wall": wall,
            "rss_mib": rss, "batched": batched}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="an mlx-lm model directory (default: convert the embedded model)")
    p.add_argument("--requests", type=int, default=8, help="concurrent chat completions per run")
    p.add_argument("--prompt-tokens", type=int, default=1500)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-kv-size", type=int, default=512, help="the h2o budget")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600.0, help="deadline of each request, seconds")
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from mlx_h2o.convert import convert

            model_dir = str(convert(Path(tmp) / "model"))
        from mlx_lm.utils import load_tokenizer

        tokenizer = load_tokenizer(Path(model_dir))
        prompts = [serving.long_prompt(tokenizer, args.prompt_tokens, seed=i) for i in range(args.requests)]
        policies = {
            "h2o": ["--kv-policy", "h2o", "--kv-option", f"max_kv_size={args.max_kv_size}"],
            "full": ["--kv-policy", "full"],
        }
        rows = {name: [] for name in policies}
        for r in range(args.repeats):
            order = list(policies) if r % 2 == 0 else list(policies)[::-1]
            for name in order:
                rows[name].append(run_policy(model_dir, policies[name], prompts, args.max_tokens, args.timeout))
                print(f"repeat {r} {name}: {rows[name][-1]}", flush=True)

    def med(name, key):
        return statistics.median(x[key] for x in rows[name])

    print(f"\n{args.requests} concurrent streamed chat completions, prompts >= {args.prompt_tokens} tokens, "
          f"{args.max_tokens} new tokens, median of {args.repeats} runs; load average {os.getloadavg()}")
    print("| policy | batched | requests/s | TTFT median (s) | TTFT max (s) | server RSS after (MiB) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in policies:
        print(f"| {name} | {rows[name][0]['batched']} | {med(name, 'req_s'):.3f} | {med(name, 'ttft_median'):.2f} | "
              f"{med(name, 'ttft_max'):.2f} | {med(name, 'rss_mib'):.0f} |")
    print(f"h2o/full: requests/s x{med('h2o', 'req_s') / med('full', 'req_s'):.2f}, "
          f"TTFT median x{med('h2o', 'ttft_median') / med('full', 'ttft_median'):.2f}  (provisional: shared machine)")


if __name__ == "__main__":
    main()
