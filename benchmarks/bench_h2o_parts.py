"""Before/after perplexity of every tracked h2o configuration (guard for the h2o refactor).

Autoregressive PPL on the tuning documents (doc set 0; default 2 samples x 512 tokens, prefill 32)
of the embedded model, with every cache bounded at M = 128 so that all of them evict: the full,
rotating and unbounded baselines, h2o at its defaults, each h2o option family on its own, the
combinations the docs use, and the other policies at their defaults. A refactor that keeps the
arithmetic must reproduce every PPL to 4 decimals.

    PYTHONPATH=WORKTREE/src build/venv-stock/bin/python benchmarks/bench_h2o_parts.py --json before.json
    PYTHONPATH=src build/venv-stock/bin/python benchmarks/bench_h2o_parts.py --compare docs/results/h2o-parts/before.json [--changed SPEC ...]

(PYTHONPATH picks the package under test over the venv's installed copy; the first line printed says which.)

--compare prints | config | PPL before | PPL after | Δ | identical to 4 dp | and exits 1 when a row
not named by --changed differs (or failed to build/run after); only the specs this run tried are
compared. --after JSON compares saved rows without running.
Policies are decoded together in groups of KERNEL_MAX_ROWS // samples (8 rows): every decode step
then stays on the int8 matmul kernel, whose rows do not depend on which policies share the batch,
so the numbers equal one-policy-at-a-time runs and do not shift when a spec is added or removed.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import mlx_h2o  # isort: skip

mlx_h2o.use_openblas()  # as `mlx-h2o eval`: OpenBLAS matmuls, before mlx.core loads

from mlx_h2o import cpu_layers, hook
from mlx_h2o.evaluation import load_corpus
from mlx_h2o.evaluation.corpus import set_samples
from mlx_h2o.evaluation.runner import parse_specs, perplexity_table

SPECS = [
    "full", "rotating", "reserved", "quantized", "rotated",
    "h2o", "h2o:score=cumulative", "h2o:score=ema", "h2o:score=logit_ema", "h2o:score=ema,decay=0.5",
    "h2o:split=balanced", "h2o:split=recent", "h2o:split=explicit,heavy=0,recent={R}", "h2o:select=layer",
    "h2o:evict_every=1", "h2o:obs_window=16", "h2o:pool=3", "h2o:chunk=4",
    "h2o:expected=0.5", "h2o:redundancy=0.5", "h2o:merge=0.5",
    "h2o:evicted_bits=2", "h2o:evicted_bits=2,score=cumulative,rotate=true", "h2o:evicted_bits=2,evicted_share=0.75",
    "h2o:evicted_bits=k8v4", "h2o:layer_budget=pyramid", "h2o:layer_budget=dispersion", "h2o:head_budget=adaptive",
    "h2o:pin=0:16", "h2o:kv_bits=8", "h2o:kv_bits=4,rotate=true", "h2o:kv_bits=mixed,rotate=true", "h2o:kv_bits=k8v4",
    "h2o:kv_bits=4/8,rotate=true,evicted_bits=2,score=cumulative", "h2o:split=explicit,heavy=0,recent={R},kv_bits=8",
]


def run(args):
    mlx_h2o.use_fast_cpu_attention(True)  # as `mlx-h2o eval` (--attention fused)
    model, tokenizer = mlx_h2o.load()
    attention = "fused CPU kernel" if hook.fast_cpu_attention_enabled() else "mlx-lm stock"
    print(f"BLAS: {mlx_h2o.blas_backend()}; attention: {attention}", file=sys.stderr)
    samples = set_samples(tokenizer, load_corpus(), 0, args.samples, args.seq_len, seed=0)
    print("doc set 0: " + ", ".join(os.path.basename(s[0]) for s in samples), file=sys.stderr)
    specs, skipped = [], []
    for text in (s.replace("{R}", str(args.M - 4)) for s in args.specs):
        try:
            [spec] = parse_specs([text], [args.M])
            mlx_h2o.make_cache(model, spec.policy, **spec.options)
            specs.append((text, spec))
        except Exception as e:  # noqa: BLE001 -- report and go on: a spec this code does not know
            skipped.append({"config": text, "error": f"{type(e).__name__}: {e}"})
            print(f"SKIPPED {text}: {type(e).__name__}: {e}", file=sys.stderr)
    pb = args.policy_batch or max(1, cpu_layers.KERNEL_MAX_ROWS // args.samples)
    rows, t0 = [], time.perf_counter()
    for g in range(0, len(specs), pb):
        group = specs[g : g + pb]
        print(f"[{g + len(group)}/{len(specs)}] {', '.join(t for t, _ in group)}", file=sys.stderr, flush=True)
        try:
            out = perplexity_table(model, [s for _, s in group], samples, prefill=32, progress=True, policy_batch_size=pb)
        except Exception as e:  # noqa: BLE001 -- one broken policy must not lose the others' rows
            print(f"  group failed ({type(e).__name__}: {e}); skipping it: rerun those specs with --specs", file=sys.stderr)
            skipped += [{"config": t, "error": f"run: {type(e).__name__}: {e}"} for t, _ in group]
            continue
        for (text, _), r in zip(group, out):
            r.pop("delta_pct", None)
            rows.append({"config": text, **r})
            print(f"  {text:58s} PPL {r['ppl']:.4f}", file=sys.stderr, flush=True)
    full = next((r["ppl"] for r in rows if r["config"] == "full"), None)
    for r in rows:
        r["delta_vs_full"] = None if full is None else r["ppl"] - full
    git = subprocess.run(["git", "-C", os.path.dirname(mlx_h2o.__file__), "describe", "--always", "--dirty"],
                         capture_output=True, text=True).stdout.strip()
    return {"mlx_h2o": mlx_h2o.__file__, "git": git, "blas": mlx_h2o.blas_backend(), "attention": attention,
            "doc_set": 0, "seq_len": args.seq_len, "samples": args.samples, "M": args.M, "prefill": 32,
            "policy_batch": pb, "seconds": time.perf_counter() - t0, "rows": rows, "skipped": skipped}


def _f(x, spec=".4f"):
    return "—" if x is None else format(x, spec)


def compare(before, after, changed):
    old = {r["config"]: r["ppl"] for r in before["rows"]}
    new = {r["config"]: r["ppl"] for r in after["rows"]}
    for k in ("seq_len", "samples", "M", "policy_batch"):
        if before.get(k) != after.get(k):
            print(f"WARNING: {k} differs: before {before.get(k)}, after {after.get(k)}", file=sys.stderr)
    print("| config | PPL before | PPL after | Δ | identical to 4 dp |\n|---|---|---|---|---|")
    bad = []
    tried = list(new) + [s["config"] for s in after.get("skipped", [])]  # a spec not tried is not compared
    for name in [n for n in old if n in tried] + [n for n in tried if n not in old]:
        b, a = old.get(name), new.get(name)
        same = b is not None and a is not None and f"{b:.4f}" == f"{a:.4f}"
        note = "yes" if same else ("no (changed on purpose)" if name in changed else "**NO**")
        print(f"| {name} | {_f(b)} | {_f(a)} | {_f(None if None in (a, b) else a - b, '+.4f')} | {note} |")
        if not same and name not in changed:
            bad.append(name)
    print(f"\n{len(bad)} config(s) should be identical and are not: {', '.join(bad)}" if bad else "\nall identical", file=sys.stderr)
    return 1 if bad else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--M", type=int, default=128, help="max_kv_size of every bounded policy (default 128)")
    ap.add_argument("--specs", nargs="+", default=SPECS, help="policy specs (default: the tracked list; {R} = M - 4)")
    ap.add_argument("--policy-batch", type=int, default=None, help="policies decoded together (default KERNEL_MAX_ROWS // samples)")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--compare", metavar="BEFORE.json", help="print before/after and exit 1 on an unexpected change")
    ap.add_argument("--after", metavar="AFTER.json", help="with --compare: take these rows instead of running")
    ap.add_argument("--changed", nargs="*", default=[], metavar="SPEC", help="configs whose arithmetic changed on purpose")
    args = ap.parse_args()
    print(f"mlx_h2o: {mlx_h2o.__file__}", file=sys.stderr)
    result = json.load(open(args.after)) if args.after else run(args)
    if not args.after:
        print(f"{len(result['rows'])} rows in {result['seconds']:.0f} s; skipped: {len(result['skipped'])}", file=sys.stderr)
        print("| config | PPL | ΔPPL vs full |\n|---|---|---|")
        for r in result["rows"]:
            print(f"| {r['config']} | {r['ppl']:.4f} | {_f(r['delta_vs_full'], '+.4f')} |")
        for s in result["skipped"]:
            print(f"| {s['config']} | skipped: {s['error']} | |")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.compare:
        return compare(json.load(open(args.compare)), result, set(args.changed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
