"""One table (and a plot) from several `mlx-h2o eval --json` files of the same samples.

    python benchmarks/report_results.py results/ppl_main.json results/ppl_rules.json [--plot out.png]

Long sweeps are split into several eval runs so each can be checked while the next runs; with the
same --seed, --seq-len and --samples they evaluate identical token sequences (eval prints the
documents the samples come from), so ΔPPL is taken against the full-cache row of the same length
and sample count from any of the files. Columns:

- ΔPPL vs full, and for a bounded cache its ΔPPL as a fraction of the sliding window's
  (`rotating`) at the same budget: the ratio the project's H2O goals are stated in;
- KV bytes per held token: the cache's measured `nbytes` at the end of the sequence divided by
  the tokens it holds then (min(M, length - 1)), so compression ratios are measured, not computed.
"""

import argparse
import json

from mlx_h2o.evaluation.report import markdown_table, plot_sweep


def _held(row) -> int:
    # The last token of a sample is only predicted, never fed: seq_len - 1 tokens went through the cache.
    fed = row["seq_len"] - 1
    m = row["max_kv_size"]
    return fed if m is None else min(m, fed)


def merged_rows(paths):
    rows = [r for p in paths for r in json.load(open(p))["perplexity"]]
    full = {(r["seq_len"], r["samples"]): r["ppl"] for r in rows if r["policy"] == "full"}
    for r in rows:
        ref = full.get((r["seq_len"], r["samples"]))
        r["delta_pct"] = None if ref is None else 100.0 * (r["ppl"] / ref - 1.0)
    window = {(r["seq_len"], r["samples"], r["max_kv_size"]): r["delta_pct"] for r in rows if r["policy"] == "rotating"}
    fp_bytes = {(r["seq_len"], r["samples"]): r["kv_bytes_per_seq"] / _held(r) for r in rows if r["policy"] == "full"}
    for r in rows:
        w = window.get((r["seq_len"], r["samples"], r["max_kv_size"]))
        r["vs_window"] = None if not w or r["delta_pct"] is None else r["delta_pct"] / w
        r["bytes_per_token"] = r["kv_bytes_per_seq"] / _held(r)
        fp = fp_bytes.get((r["seq_len"], r["samples"]))
        r["compression"] = None if fp is None else fp / r["bytes_per_token"]
    return rows


def results_markdown(rows) -> str:
    def fmt(v, spec, none="-"):
        return none if v is None else format(v, spec)

    return markdown_table(
        ["policy", "seq", "PPL", "ΔPPL vs full", "ΔPPL / window's", "KV bytes per held token", "vs full cache's"],
        [
            [
                r["label"],
                r["seq_len"],
                f"{r['ppl']:.3f}",
                fmt(r["delta_pct"], "+.2f") + (" %" if r["delta_pct"] is not None else ""),
                fmt(r["vs_window"], ".2f") + ("×" if r["vs_window"] is not None else ""),
                f"{r['bytes_per_token']:.0f}",
                fmt(r["compression"] and 1 / r["compression"], ".3f"),
            ]
            for r in rows
        ],
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="+", help="files written by mlx-h2o eval --json")
    ap.add_argument("--plot", help="write a PNG of ΔPPL vs budget here")
    ap.add_argument("--title", default=None)
    args = ap.parse_args()
    rows = merged_rows(args.json)
    print(results_markdown(rows))
    if args.plot and plot_sweep(rows, args.plot, title=args.title):
        print(f"\nwrote {args.plot}")


if __name__ == "__main__":
    main()
