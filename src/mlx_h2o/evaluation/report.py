"""Tables (Markdown), JSON and PNG plots for harness results."""

import json
from typing import List, Optional, Sequence


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def perplexity_markdown(rows: List[dict]) -> str:
    return markdown_table(
        ["policy", "seq", "PPL", "ΔPPL vs full", "KV MB/seq", "tok/s"],
        [
            [
                r["label"],
                r["seq_len"],
                f"{r['ppl']:.3f}",
                "-" if r["delta_pct"] is None else f"{r['delta_pct']:+.2f} %",
                f"{r['kv_bytes_per_seq'] / 2**20:.2f}",
                f"{r['tok_s']:.1f}",
            ]
            for r in rows
        ],
    )


def speed_markdown(rows: List[dict]) -> str:
    return markdown_table(
        ["policy", "context", "decode tok/s", "p50 ms", "p99 ms", "max ms", "KV MB", "MLX peak MB", "RSS MB"],
        [
            [
                r["label"],
                r["context"],
                f"{r['decode_tok_s']:.1f}",
                f"{r['p50_ms']:.1f}",
                f"{r['p99_ms']:.1f}",
                f"{r['max_ms']:.1f}",
                f"{r['kv_bytes'] / 2**20:.1f}",
                f"{r['mlx_peak_bytes'] / 2**20:.0f}",
                f"{r['rss_bytes'] / 2**20:.0f}",
            ]
            for r in rows
        ],
    )


def write_json(path: str, payload: dict) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=str)


def plot_sweep(rows: List[dict], path: str, title: Optional[str] = None) -> Optional[str]:
    """ΔPPL % against the budget M (one line per policy family and length), or against the sequence
    length when only lengths vary. Returns the path, or None when there is nothing to sweep."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bounded = [r for r in rows if r["max_kv_size"] is not None and r["delta_pct"] is not None]
    sizes = {r["max_kv_size"] for r in bounded}
    lengths = {r["seq_len"] for r in rows}
    if len(sizes) < 2 and len(lengths) < 2:
        return None
    x_key = "max_kv_size" if len(sizes) >= 2 else "seq_len"
    families = {}
    for r in bounded:
        opts = {k: v for k, v in r["options"].items() if k != "max_kv_size"}
        name = r["policy"] + ("(" + ",".join(f"{k}={v}" for k, v in opts.items()) + ")" if opts else "")
        if x_key == "max_kv_size" and len(lengths) > 1:
            name += f" seq={r['seq_len']}"
        families.setdefault(name, []).append((r[x_key], r["delta_pct"]))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, pts in sorted(families.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.axhline(0.0, color="black", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("KV budget M (tokens)" if x_key == "max_kv_size" else "sequence length (tokens)")
    ax.set_ylabel("ΔPPL vs full cache (%)")
    ax.set_title(title or "Perplexity cost of a bounded KV cache")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
