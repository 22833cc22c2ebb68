"""The fork's MLX wheel against PyPI's mlx[cpu], op by op and on mlx-lm's own decode, side by side.

Two MLX builds cannot share a process, so each measurement runs in a worker process of each venv
(build/venv-stock: PyPI's MLX; build/venv-fork: the custom wheels, scripts/build_wheels.sh), the two
alternating round after round; every worker times its op `--reps` times after a warm-up and reports
the median. The table gives the median over rounds of each side, the spread (min-max over rounds) and
the ratio fork / stock of the medians (> 1: the fork is faster). The load average is printed before
every round: take the numbers only from a quiet machine (1-minute load < 1).

    python benchmarks/bench_fork.py --rounds 5                      # ops
    python benchmarks/bench_fork.py --decode --rounds 3            # + mlx_lm.generate decode tok/s

--decode compares `mlx_lm.generate` from the custom wheels (the fork's kernels, no wrapper) with
`python -m mlx_h2o.run_mlx_lm generate` on stock MLX + stock mlx-lm (mlx-h2o's kernels and OpenBLAS
switched in by the wrapper), on the embedded model converted to an mlx-lm directory, the same prompt
(--prompt-tokens tokens of a licence text), greedy, --max-tokens tokens.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENVS = {"stock": ROOT / "build" / "venv-stock" / "bin" / "python", "fork": ROOT / "build" / "venv-fork" / "bin" / "python"}

# name -> (setup, timed expression): run by the worker with mx imported
OPS = {
    "matmul f32 512x512x512": ("a = mx.random.normal((512, 512)); b = mx.random.normal((512, 512))", "a @ b"),
    "matmul f32 4096x4096 @ 4096x1": ("a = mx.random.normal((4096, 4096)); b = mx.random.normal((4096, 1))", "a @ b"),
    "matmul f32 1x4096 @ 4096x4096": ("a = mx.random.normal((1, 4096)); b = mx.random.normal((4096, 4096))", "a @ b"),
    "sdpa f32 decode N=2048 (1,9,1,64)/(1,3,N,64)": (
        "q = mx.random.normal((1, 9, 1, 64)); k = mx.random.normal((1, 3, 2048, 64)); v = mx.random.normal((1, 3, 2048, 64))",
        "mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125)"),
    "sdpa f32 decode N=8192": (
        "q = mx.random.normal((1, 9, 1, 64)); k = mx.random.normal((1, 3, 8192, 64)); v = mx.random.normal((1, 3, 8192, 64))",
        "mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125)"),
    "sdpa f16 decode N=8192": (
        "q = mx.random.normal((1, 9, 1, 64)).astype(mx.float16); k = mx.random.normal((1, 3, 8192, 64)).astype(mx.float16); "
        "v = mx.random.normal((1, 3, 8192, 64)).astype(mx.float16)",
        "mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125)"),
    "sdpa f32 prefill causal L=N=512": (
        "q = mx.random.normal((1, 9, 512, 64)); k = mx.random.normal((1, 3, 512, 64)); v = mx.random.normal((1, 3, 512, 64))",
        "mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask='causal')"),
    "qmm 4-bit g32 1x576 @ 1536x576": (
        "w = mx.quantize(mx.random.normal((1536, 576)), 32, 4); x = mx.random.normal((1, 576))",
        "mx.quantized_matmul(x, *w, transpose=True, group_size=32, bits=4)"),
    "qmm 4-bit g64 1x4096 @ 4096x4096": (
        "w = mx.quantize(mx.random.normal((4096, 4096)), 64, 4); x = mx.random.normal((1, 4096))",
        "mx.quantized_matmul(x, *w, transpose=True, group_size=64, bits=4)"),
    "qmm 8-bit g32 1x576 @ 49152x576 (lm_head)": (
        "w = mx.quantize(mx.random.normal((49152, 576)), 32, 8); x = mx.random.normal((1, 576))",
        "mx.quantized_matmul(x, *w, transpose=True, group_size=32, bits=8)"),
    "qmm 4-bit g32 512x576 @ 1536x576 (prefill)": (
        "w = mx.quantize(mx.random.normal((1536, 576)), 32, 4); x = mx.random.normal((512, 576))",
        "mx.quantized_matmul(x, *w, transpose=True, group_size=32, bits=4)"),
    "rms_norm f32 (1,1,576)": ("x = mx.random.normal((1, 1, 576)); w = mx.ones((576,))", "mx.fast.rms_norm(x, w, 1e-5)"),
    "rope f32 (1,9,1,64) offset 1000": ("x = mx.random.normal((1, 9, 1, 64))",
                                        "mx.fast.rope(x, 64, traditional=False, base=10000.0, scale=1.0, offset=1000)"),
}

WORKER = """
import json, sys, time
import mlx.core as mx
setup, expr, reps = sys.argv[1], sys.argv[2], int(sys.argv[3])
exec(setup)
mx.eval([v for v in dict(globals()).values() if isinstance(v, mx.array)])
f = eval("lambda: " + expr)
for _ in range(3):
    mx.eval(f())
times = []
for _ in range(reps):
    t0 = time.perf_counter(); mx.eval(f()); times.append(time.perf_counter() - t0)
times.sort()
print(json.dumps({"us": times[len(times) // 2] * 1e6, "mlx": mx.__version__}))
"""


def load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def op_round(kind, setup, expr, reps):
    r = subprocess.run([str(VENVS[kind]), "-c", WORKER, setup, expr, str(reps)], capture_output=True, text=True,
                       env={**os.environ, "MLX_H2O_BLAS": "reference"})
    if r.returncode:
        raise SystemExit(f"{kind} worker failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def decode_round(kind, model_dir, prompt_file, max_tokens):
    if kind == "fork":
        cmd = [str(VENVS["fork"].parent / "mlx_lm.generate")]
    else:
        cmd = [str(VENVS["stock"]), "-m", "mlx_h2o.run_mlx_lm", "generate"]
    cmd += ["--model", str(model_dir), "--prompt", "-", "--max-tokens", str(max_tokens), "--temp", "0.0",
            "--ignore-chat-template"]
    with open(prompt_file) as stdin:
        r = subprocess.run(cmd, stdin=stdin, capture_output=True, text=True)
    out = r.stdout + r.stderr
    gen = re.search(r"Generation: (\d+) tokens, ([\d.]+) tokens-per-sec", out)
    pre = re.search(r"Prompt: (\d+) tokens, ([\d.]+) tokens-per-sec", out)
    if r.returncode or not gen:
        raise SystemExit(f"{kind} generate failed:\n{out[-3000:]}")
    return {"decode_tok_s": float(gen.group(2)), "prefill_tok_s": float(pre.group(2)), "prompt": int(pre.group(1))}


def summarize(rows, key, higher_is_better):
    out = {}
    for kind in ("stock", "fork"):
        vals = [r[kind][key] for r in rows]
        out[kind] = (statistics.median(vals), min(vals), max(vals))
    ratio = out["fork"][0] / out["stock"][0] if higher_is_better else out["stock"][0] / out["fork"][0]
    return out, ratio


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--ops", nargs="*", default=None, help="substrings of op names (default: all)")
    ap.add_argument("--decode", action="store_true")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    for kind, py in VENVS.items():
        if not py.exists():
            raise SystemExit(f"{py} is missing: scripts/venv.sh {kind}" + (" (after scripts/build_wheels.sh)" if kind == "fork" else ""))
    ops = {k: v for k, v in OPS.items() if not args.ops or any(s in k for s in args.ops)}
    results = {"ops": {}, "decode": None, "loads": []}
    for name, (setup, expr) in ops.items():
        rows = []
        for i in range(args.rounds):
            results["loads"].append(load())
            rows.append({kind: op_round(kind, setup, expr, args.reps) for kind in (("stock", "fork") if i % 2 == 0 else ("fork", "stock"))})
        (summary, ratio) = summarize(rows, "us", higher_is_better=False)
        results["ops"][name] = {"summary": summary, "ratio": ratio, "mlx": {k: rows[0][k]["mlx"] for k in rows[0]}}
        print(f"{name:48s} stock {summary['stock'][0]:9.1f} us  fork {summary['fork'][0]:9.1f} us  fork speed {ratio:5.2f}x"
              f"  (load {load()})", flush=True)
    if args.decode:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = Path(tmp) / "smollm2"
            subprocess.run([str(VENVS["stock"]), "-m", "mlx_h2o", "convert", "--out", str(model_dir)], check=True,
                           capture_output=True)
            prompt = Path(tmp) / "prompt.txt"
            code = ("import sys\n"
                    "from mlx_lm import load; m, t = load(sys.argv[1]); ids = t.encode(open('/usr/share/common-licenses/GPL-3').read())"
                    "[:int(sys.argv[2])]; print(t.decode(ids))")
            text = subprocess.run([str(VENVS["stock"]), "-c", code, str(model_dir), str(args.prompt_tokens)], check=True,
                                  capture_output=True, text=True).stdout
            prompt.write_text(text)
            rows = []
            for i in range(args.rounds):
                results["loads"].append(load())
                order = ("stock", "fork") if i % 2 == 0 else ("fork", "stock")
                rows.append({kind: decode_round(kind, model_dir, prompt, args.max_tokens) for kind in order})
                print(f"round {i + 1}: " + ", ".join(f"{k} {rows[-1][k]['decode_tok_s']:.1f} tok/s" for k in order)
                      + f" (load {load()})", flush=True)
            dec, dratio = summarize(rows, "decode_tok_s", higher_is_better=True)
            pre, pratio = summarize(rows, "prefill_tok_s", higher_is_better=True)
            results["decode"] = {"decode": dec, "decode_ratio": dratio, "prefill": pre, "prefill_ratio": pratio,
                                 "prompt_tokens": rows[0]["fork"]["prompt"], "max_tokens": args.max_tokens}
    print()
    print(f"| op | PyPI mlx[cpu] {next(iter(results['ops'].values()))['mlx']['stock'] if results['ops'] else ''} µs (min-max) "
          f"| fork µs (min-max) | fork speed |")
    print("|---|---|---|---|")
    for name, r in results["ops"].items():
        s, f = r["summary"]["stock"], r["summary"]["fork"]
        print(f"| {name} | {s[0]:.1f} ({s[1]:.1f}-{s[2]:.1f}) | {f[0]:.1f} ({f[1]:.1f}-{f[2]:.1f}) | {r['ratio']:.2f}x |")
    if results["decode"]:
        d = results["decode"]
        print()
        print(f"| SmolLM2-135M, {d['prompt_tokens']}-token prompt, {d['max_tokens']} tokens | run_mlx_lm on stock MLX "
              "| mlx_lm.generate on the custom wheels | ratio |")
        print("|---|---|---|---|")
        for key, label in (("decode", "decode tok/s"), ("prefill", "prefill tok/s")):
            s, f = d[key]["stock"], d[key]["fork"]
            print(f"| {label} (median, min-max) | {s[0]:.1f} ({s[1]:.1f}-{s[2]:.1f}) | {f[0]:.1f} ({f[1]:.1f}-{f[2]:.1f}) "
                  f"| {d[key + '_ratio']:.2f}x |")
    print(f"\nload averages before the rounds: {', '.join(sorted(set(results['loads'])))}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
