"""Per-set tables of docs/results/h2o-methods/README.md from the JSON files beside it:
python3 docs/results/h2o-methods/tables.py (PPL rows from ppl_set*.json, recall from recall_set*.json and
the set-0 screens)."""

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


def table(doc_set):
    ppl = load(f"ppl_set{doc_set}.json", "perplexity")
    recall_files = [f"recall_set{doc_set}.json"] + (["screen_recall_archive*_set0.json"] if doc_set == 0 else [])
    recall = {}
    for pattern in recall_files:
        recall.update({k: v for k, v in load(pattern, "recall").items() if v["span"] == 64 and v["filler"] == 1000 and k not in recall})
    full = next((r["ppl"] for r in ppl.values() if r["policy"] == "full"), None)
    window = {r["max_kv_size"]: r["ppl"] for r in ppl.values() if r["policy"] == "rotating"}
    out = ["| policy | M | PPL | ΔPPL vs full | ΔPPL ratio vs window | recall share (S=64, F=1000) | KV MB/seq (PPL, seq 2048) | KV MB/seq (recall) |",
           "|---|---|---|---|---|---|---|---|"]
    for k in sorted(set(ppl) | set(recall), key=lambda k: (k[1] or 0, k[0] != "full", k[0] != "rotating", k[2] != "{}", k[2])):
        p, q = ppl.get(k), recall.get(k)
        r = p or q
        opts = ",".join(f"{a}={b}" for a, b in sorted(json.loads(k[2]).items()))
        name = r["policy"] + (f"({opts})" if opts else "")
        cells = [name, str(k[1] or "-")]
        if p:
            d = p["ppl"] - full if full else None
            dw = window.get(k[1], None)
            ratio = d / (dw - full) if (d is not None and dw and dw != full and k[0] != "full") else None
            cells += [f"{p['ppl']:.3f}", f"{100 * d / full:+.2f} %" if d is not None else "-", "-" if ratio is None else f"{ratio:.2f}×"]
        else:
            cells += ["-", "-", "-"]
        cells.append("-" if not q or q["recovered"] is None else f"{100 * q['recovered']:.0f} %")
        cells.append(f"{p['kv_bytes_per_seq'] / 2**20:.2f}" if p else "-")
        cells.append(f"{q['kv_bytes_per_seq'] / 2**20:.2f}" if q else "-")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    for s in map(int, sys.argv[1:] or ["0", "1", "2"]):
        print(f"### Set {s} ({'tuning' if s == 0 else 'held out'})\n")
        print(table(s))
        print()
