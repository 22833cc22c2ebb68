"""Per-set tables of docs/results/h2o-methods/README.md from the JSON files beside it:
python3 docs/results/h2o-methods/tables.py (PPL rows from ppl_set*.json, recall from recall_set*.json and
the set-0 screens); python3 docs/results/h2o-methods/tables.py --plot [PNG] draws ΔPPL against M per set."""

import json
import sys
from pathlib import Path

HERE = Path(__file__).parent


def key(r):
    opts = {k: v for k, v in r["options"].items() if k != "max_kv_size"}
    return r["policy"], r["max_kv_size"], json.dumps(opts, sort_keys=True)


def load(pattern, field):
    rows = {}
    for f in sorted(HERE.glob(pattern)):
        for r in json.load(open(f))[field]:
            rows.setdefault(key(r), r)
    return rows


def set_name(s):
    return f"set {s} ({'tuning' if s == 0 else 'held out'})"


def full_row(ppl):
    """The full cache's row of a set's PPL rows (None if that set has no PPL run)."""
    return next((r for r in ppl.values() if r["policy"] == "full"), None)


def options_text(r):
    """A row's options but the budget, "a=1,b=2" (empty when none)."""
    return ",".join(f"{a}={b}" for a, b in sorted(r["options"].items()) if a != "max_kv_size")


def per_document(row, ppl, M):
    """The ΔPPL ratio vs the window document by document, as min–max (how much one document moves it)."""
    full = full_row(ppl)
    window = next((r for r in ppl.values() if r["policy"] == "rotating" and r["max_kv_size"] == M), None)
    if row["policy"] in ("full", "rotating") or not full or not window or len(row["sample_ppl"]) < 2:
        return "-"
    ratios = [(p - f) / (w - f) for p, f, w in zip(row["sample_ppl"], full["sample_ppl"], window["sample_ppl"]) if w != f]
    return f"{min(ratios):.2f}–{max(ratios):.2f}"


def label(r):
    """A row's name; an h2o cache with no heavy hitters is a (packed) sliding window with 4 sinks."""
    o = r["options"]
    if r["policy"] == "h2o" and o.get("split") == "explicit" and o.get("heavy") == 0:
        return f"window, {o.get('kv_bits')}-bit{' rotated' if o.get('rotate') else ''} (h2o heavy=0)"
    if r["policy"] == "rotating":
        return "window, fp32 (rotating)"
    return policy_name(r)


def policy_name(r, policy=None):
    """`policy(options)`, as the eval and recall tables name a row."""
    opts = options_text(r)
    return (policy or r["policy"]) + (f"({opts})" if opts else "")


def bytes_table(doc_set, window_M=256):
    """Policies held to the bytes of the fp32 window at `window_M` (ppl_bytes*_set*.json, 70-110 % of its
    bytes), against that window and against the 8-bit window of the same bytes."""
    ppl = load(f"ppl_set{doc_set}.json", "perplexity")
    ppl.update(load(f"ppl_bytes*_set{doc_set}.json", "perplexity"))
    full = (full_row(ppl) or {}).get("ppl")
    window = next((r for r in ppl.values() if r["policy"] == "rotating" and r["options"] == {"max_kv_size": window_M}), None)
    if full is None or window is None:
        return "(not measured)"
    budget = window["kv_bytes_per_seq"]
    rows = [r for r in ppl.values() if r["policy"] != "full" and r["max_kv_size"] and 0.7 * budget <= r["kv_bytes_per_seq"] <= 1.1 * budget
            and (r["max_kv_size"] > window_M or r is window)]
    w8 = next((r for r in rows if label(r).startswith("window, 8-bit")), None)
    out = [f"| policy | M | KV MB/seq | PPL | ΔPPL vs full | ΔPPL ratio vs fp32 window (M = {window_M}) | vs 8-bit window (same bytes) |",
           "|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: r["ppl"], reverse=True):
        d = r["ppl"] - full
        vs8 = f"{d / (w8['ppl'] - full):.2f}×" if w8 else "-"
        out.append(f"| {label(r)} | {r['max_kv_size']} | {r['kv_bytes_per_seq'] / 2**20:.2f} | {r['ppl']:.3f} | "
                   f"{100 * d / full:+.2f} % | {d / (window['ppl'] - full):.2f}× | {vs8} |")
    return "\n".join(out)


def recall_sweep(pattern):
    """Every recall row of the files matching `pattern`: share recovered per policy, budget, span, filler, chunk."""
    rows = [r for f in sorted(HERE.glob(pattern)) for r in json.load(open(f))["recall"]]
    if not rows:
        return "(not measured)"
    probe = lambda q: (q["doc_set"], q["span"], q["filler"], q["chunk"], q.get("trials"))  # noqa: E731  (one probe's rows)
    out = ["| set | span | filler | prompt fed | policy | M | NLL on the repeat | recall share | KV MB/seq |", "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["doc_set"], r["span"], r["filler"], str(r["chunk"]), r["max_kv_size"] or 0, r["policy"] != "full", r["policy"] != "rotating")):
        share = "-" if r["recovered"] is None else f"{100 * r['recovered']:.0f} %"
        if r["recovered"] is None and r["policy"] != "full":
            # no window of this M in the run: the share against the run's one window (of the same bytes)
            windows = [q for q in rows if q["policy"] == "rotating" and probe(q) == probe(r)]
            full = next((q for q in rows if q["policy"] == "full" and probe(q) == probe(r)), None)
            if len(windows) == 1 and full and windows[0]["nll"] != full["nll"]:
                w = windows[0]
                share = f"{100 * (w['nll'] - r['nll']) / (w['nll'] - full['nll']):.0f} % (vs window M = {w['max_kv_size']})"
        fed = f"chunks of {r['chunk']}" if r["chunk"] else "token by token"
        out.append(f"| {r['doc_set']} | {r['span']} | {r['filler']} | {fed} | {label(r)} | {r['max_kv_size'] or '-'} | {r['nll']:.3f} | {share} | {r['kv_bytes_per_seq'] / 2**20:.2f} |")
    return "\n".join(out)


def table(doc_set):
    ppl = load(f"ppl_set{doc_set}.json", "perplexity")
    recall_files = [f"recall_set{doc_set}.json"] + (["screen_recall_archive*_set0.json"] if doc_set == 0 else [])
    recall = {}
    for pattern in recall_files:
        recall.update({k: v for k, v in load(pattern, "recall").items() if v["span"] == 64 and v["filler"] == 1000 and k not in recall})
    full = (full_row(ppl) or {}).get("ppl")
    window = {r["max_kv_size"]: r["ppl"] for r in ppl.values() if r["policy"] == "rotating"}
    out = ["| policy | M | PPL | ΔPPL vs full | ΔPPL ratio vs window | per document | recall share (S=64, F=1000) | KV MB/seq (PPL, seq 2048) | KV MB/seq (recall) |",
           "|---|---|---|---|---|---|---|---|---|"]
    for k in sorted(set(ppl) | set(recall), key=lambda k: (k[1] or 0, k[0] != "full", k[0] != "rotating", k[2] != "{}", k[2])):
        p, q = ppl.get(k), recall.get(k)
        cells = [policy_name(p or q), str(k[1] or "-")]
        if p:
            d = p["ppl"] - full if full else None
            dw = window.get(k[1], None)
            ratio = d / (dw - full) if (d is not None and dw and dw != full and k[0] != "full") else None
            cells += [f"{p['ppl']:.3f}", f"{100 * d / full:+.2f} %" if d is not None else "-", "-" if ratio is None else f"{ratio:.2f}×",
                      per_document(p, ppl, k[1])]
        else:
            cells += ["-", "-", "-", "-"]
        cells.append("-" if not q or q["recovered"] is None else f"{100 * q['recovered']:.0f} %")
        cells.append(f"{p['kv_bytes_per_seq'] / 2**20:.2f}" if p else "-")
        cells.append(f"{q['kv_bytes_per_seq'] / 2**20:.2f}" if q else "-")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def summary(sets=(0, 1, 2)):
    """ΔPPL ratio vs the window per bounded policy and M, one column per set (the headline table)."""
    ratios = {}
    for s in sets:
        ppl = load(f"ppl_set{s}.json", "perplexity")
        full = (full_row(ppl) or {}).get("ppl")
        window = {r["max_kv_size"]: r["ppl"] for r in ppl.values() if r["policy"] == "rotating"}
        for k, r in ppl.items():
            if r["policy"] != "full" and full and window.get(k[1]):
                name = policy_name(r, "window" if r["policy"] == "rotating" else None)
                ratios.setdefault((k[1], name), {})[s] = ((r["ppl"] - full) / (window[k[1]] - full), 100 * (r["ppl"] - full) / full)
    head = " | ".join(set_name(s) for s in sets)
    out = [f"| M | policy | {head} |", "|---|---|" + "---|" * len(sets)]
    for (M, name), per_set in sorted(ratios.items(), key=lambda kv: (kv[0][0], kv[0][1] != "window", kv[0][1])):
        cells = [f"{per_set[s][0]:.2f}× ({per_set[s][1]:+.1f} %)" if s in per_set else "-" for s in sets]
        out.append(f"| {M} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def plot(path, sets=(0, 1, 2)):
    """ΔPPL vs full per set: against M (top; same-M policies), and against the KV bytes held (bottom;
    the equal-bytes runs too, named by storage)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(sets), figsize=(4.4 * len(sets), 7.2), sharey="row")
    for col, s in enumerate(sets):
        ppl = load(f"ppl_set{s}.json", "perplexity")
        full = (full_row(ppl) or {}).get("ppl")
        if full is None:
            continue
        by_bytes = dict(ppl)
        by_bytes.update(load(f"ppl_bytes*_set{s}.json", "perplexity"))
        for row, (rows, x_of) in enumerate([(ppl, lambda r: r["max_kv_size"]), (by_bytes, lambda r: r["kv_bytes_per_seq"] / 2**20)]):
            lines = {}
            for r in rows.values():
                if r["max_kv_size"]:
                    name = label(r) if row else label(r).replace("window, fp32 (rotating)", "window")
                    lines.setdefault(name, []).append((x_of(r), 100 * (r["ppl"] - full) / full))
            ax = axes[row, col]
            for name, pts in sorted(lines.items()):
                xs, ys = zip(*sorted(pts))
                ax.plot(xs, ys, marker="o", label=name)
            ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
            if row == 0:
                ax.set_xticks([128, 256, 512], ["128", "256", "512"])
                ax.set_title(set_name(s))
                ax.set_xlabel("M (entries per head and layer)")
            else:
                ax.set_xticks([4, 8, 16], ["4", "8", "16"])
                ax.set_xlabel("KV MB per sequence (seq 2048)")
    for row in range(2):
        axes[row, 0].set_ylabel("ΔPPL vs full cache (%)")
        axes[row, -1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--plot"]:
        plot(sys.argv[2] if len(sys.argv) > 2 else HERE / "ppl_vs_budget.png")
        sys.exit()
    print("### ΔPPL ratio vs the window (ΔPPL vs full in brackets), seq 2048, 4 documents per set\n")
    print(summary())
    print()
    for s in map(int, sys.argv[1:] or ["0", "1", "2"]):
        print(f"### {set_name(s).capitalize()}\n")
        print(table(s))
        print()
    for title, pattern in [("Recall sweep: span, filler and budget (chunked prompt)", "recall_sweep_set*.json"),
                           ("Recall at equal bytes", "recall_bytes*_set*.json"),
                           ("Recall, token-by-token probe (no chunked prompt)", "recall_tokens_set*.json")]:
        print(f"### {title}\n")
        print(recall_sweep(pattern))
        print()
    for s in map(int, sys.argv[1:] or ["0", "1", "2"]):
        for M in (128, 256):
            print(f"### Equal bytes: the bytes of an fp32 window of {M}, {set_name(s)}\n")
            print(bytes_table(s, M))
            print()
