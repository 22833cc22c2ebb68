"""The main job (`mlx-h2o demo`, scripts/demo.sh): the caches a user can pick at the same bytes, on a
long context, measured the way a chat uses them.

At each budget (a fraction of the full cache's bytes at the context; suite.equal_byte_specs) the fp
sliding window (mlx-lm's RotatingKVCache), an 8-bit window and h2o at `max_kv_bytes` run beside the
full cache on two kinds of sequence of `context` tokens, all in one batch (batched.py):
- perplexity: real documents; the first `context - CONTINUATION` tokens are a prompt fed in chunks
  of CHUNK (as mlx_lm.generate prefills), then the last CONTINUATION tokens are decoded one at a
  time and scored;
- recall: recall.py's span probe (a 64-token span, filler, the span again at the end), fed the same
  way; the share of the full cache's NLL gain on the repeat that survives (suite.py: the fp window
  of the same bytes is 0, the full cache 1).
Then, at the middle budget, each cache alone decodes after the same context: tok/s, step p99, and
the process's peak memory during the prefill's attention and the decode (MLX's peak, with the
weights; RSS).
"""

import math
import time
from typing import List, Sequence

import mlx.core as mx
import numpy as np
from tqdm.auto import tqdm

from ..caches import make_cache
from .batched import policy_batch, policy_kv_bytes
from .recall import LEAD, recall_sequences, repeat_nll
from .speed import decode_benchmark
from .suite import CACHES, SPAN, _span_survived, check_fractions, equal_byte_specs

CONTINUATION = 256
CHUNK = 256
FLOOR_PCT = 0.01  # the plot's log axis draws smaller (or negative) ΔPPL here
MIN_CONTEXT = CONTINUATION + 2 * SPAN + LEAD + 64
DEMO_CACHES = tuple(c for c in CACHES if c[0] in ("window fp", "window 8-bit", "h2o"))


def check_arguments(context: int, fractions: Sequence[float]) -> None:
    """What run_demo needs of its arguments (checked before a model loads)."""
    if context < MIN_CONTEXT:
        raise ValueError(f"context must be >= {MIN_CONTEXT} tokens (the continuation, the span twice and room), got {context}")
    check_fractions(fractions)


def run_demo(model, docs, context: int = 2048, fractions: Sequence[float] = (1 / 16, 1 / 8, 1 / 4), samples: int = 1,
             span_trials: int = 1, speed_steps: int = 32, progress: bool = True, say=print) -> List[dict]:
    """Rows, one per cache and budget: PPL and ΔPPL on the continuation, span recall, KV bytes; and
    decode speed and peak memory at the middle budget. `docs` is one document set."""
    check_arguments(context, fractions)
    if not 1 <= samples <= len(docs):
        raise ValueError(f"samples must be in [1, {len(docs)}], got {samples}")
    texts = [ids[:context] for _, ids in docs[:samples]]
    if min(len(t) for t in texts) < context:
        raise ValueError(f"the documents must hold {context} tokens each")
    spans = recall_sequences(docs, SPAN, context - LEAD - 2 * SPAN, span_trials)
    tokens = np.array(texts + [s.tokens for s in spans], dtype=np.int32)
    n = len(tokens)
    specs = equal_byte_specs(model, context, fractions, caches=DEMO_CACHES)
    start = context - CONTINUATION
    say(f"demo: {len(specs)} caches x {n} sequences of {context} tokens in one batch: the first {start} fed in chunks "
        f"of {CHUNK}, then {CONTINUATION} decoded one at a time")
    batch = policy_batch([make_cache(model, s.policy, **s.options) for s in specs], n)
    t0 = time.perf_counter()
    with tqdm(total=context - 1, desc="demo: perplexity and recall", unit="tok", disable=not progress) as bar:
        nll = repeat_nll(model, np.concatenate([tokens] * len(specs)), batch, start, chunk=CHUNK, progress=bar.update)
    say(f"demo: quality pass took {time.perf_counter() - t0:.0f} s")
    rows, span_rows = [], []
    for i, spec in enumerate(specs):
        block = nll[i * n : (i + 1) * n]
        base = {"label": spec.label, "policy": spec.policy, "options": dict(spec.options), "cache": spec.name,
                "fraction": spec.fraction, "kv_bytes_per_seq": policy_kv_bytes(batch, i) / n}
        ppl = math.exp(block[:samples].mean())
        rows.append({**base, "context": context, "ppl": ppl, "sample_ppl": [math.exp(v) for v in block[:samples].mean(axis=1)]})
        repeat = block[samples:, -(SPAN - 1):]  # the repeat's tokens 2..S (recall.py)
        span_rows.append({**base, "nll": float(repeat.mean())})
    full = next(r["ppl"] for r in rows if r["cache"] == "full")
    for r, s in zip(rows, _span_survived(span_rows, context)):
        r["delta_pct"] = 100.0 * (r["ppl"] / full - 1.0)
        r["span_nll"], r["recall"] = s["nll"], s["survived"]
    del batch
    middle = sorted(set(fractions))[len(set(fractions)) // 2]
    for r, spec in zip(rows, specs):
        if r["cache"] != "full" and r["fraction"] != middle:
            continue
        cache = make_cache(model, spec.policy, **spec.options)
        with tqdm(total=context - 1, desc=f"demo: speed of {r['cache']}", unit="tok", disable=not progress, leave=False) as bar:
            r.update(decode_benchmark(model, cache, texts[0], steps=speed_steps, prefill_chunk=CHUNK, progress=bar.update))
        del cache
        mx.clear_cache()
    for r in rows:
        r["verdict"] = verdict(r, rows)
    return rows


def verdict(row: dict, rows: List[dict]) -> str:
    """One line: what this cache costs and keeps, against the others of the same bytes."""
    mb = row["kv_bytes_per_seq"] / 2**20
    if row["cache"] == "full":
        return f"the reference: every token, {mb:.1f} MiB a sequence"
    peers = [r for r in rows if r["fraction"] == row["fraction"] and r["cache"] != "full"]
    best = min(peers, key=lambda r: r["delta_pct"])
    recall = "-" if row["recall"] is None else f"{100 * row['recall']:.0f} %"
    text = f"{row['delta_pct']:+.1f} % PPL, span recall {recall}"
    if best is row:
        others = [r for r in peers if r is not row]
        runner = min(others, key=lambda r: r["delta_pct"]) if others else None
        if runner is not None and row["delta_pct"] > 0 and runner["delta_pct"] > 0:
            text += f": the best at {mb:.1f} MiB ({row['delta_pct'] / runner['delta_pct']:.2f}x the loss of the {runner['cache']})"
        else:  # a loss at or below zero: within the sample's noise, no ratio to give
            text += f": the lowest loss at {mb:.1f} MiB"
    elif best["delta_pct"] > 0:
        text += f": {row['delta_pct'] / best['delta_pct']:.1f}x the loss of the {best['cache']} at these bytes"
    else:
        text += f": the {best['cache']} loses less at these bytes"
    return text


def demo_markdown(rows: List[dict]) -> str:
    from .report import markdown_table

    def f(v, spec, scale=1.0):
        return "-" if v is None else format(v * scale, spec)

    order = sorted(rows, key=lambda r: (-r["fraction"], r["cache"] != "full"))
    return markdown_table(
        ["bytes of full", "cache", "KV MiB/seq", "PPL", "ΔPPL", "span recall", "decode tok/s", "p99 ms", "MLX peak MiB",
         "verdict"],
        [[f"{100 * r['fraction']:.1f} %", r["cache"], f"{r['kv_bytes_per_seq'] / 2**20:.2f}", f"{r['ppl']:.3f}",
          "—" if r["cache"] == "full" else f"{r['delta_pct']:+.2f} %",
          "—" if r["cache"] == "full" else (f(r["recall"], ".0f", 100) + (" %" if r["recall"] is not None else "")),
          f(r.get("decode_tok_s"), ".1f"), f(r.get("p99_ms"), ".1f"), f(r.get("mlx_peak_bytes"), ".0f", 2**-20), r["verdict"]]
         for r in order],
    )


def plot_demo(rows: List[dict], path: str) -> str:
    """Two panels against the KV bytes per sequence: ΔPPL (%) and span recall (%), a line per cache."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    caches = [c for c in dict.fromkeys(r["cache"] for r in rows) if c != "full"]
    for c in caches:
        pts = sorted((r["kv_bytes_per_seq"] / 2**20, r["delta_pct"], r["recall"]) for r in rows if r["cache"] == c)
        a.plot([p[0] for p in pts], [max(p[1], FLOOR_PCT) for p in pts], marker="o", label=c)
        b.plot([p[0] for p in pts], [100 * (p[2] or 0.0) for p in pts], marker="o", label=c)
    full = next(r for r in rows if r["cache"] == "full")
    for ax in (a, b):
        ax.axvline(full["kv_bytes_per_seq"] / 2**20, color="gray", linestyle=":", label="full cache")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("KV MiB per sequence")
        ax.grid(True, alpha=0.3)
    a.set_ylabel(f"ΔPPL vs full cache (%, log; below {FLOOR_PCT} % drawn at it)")
    a.set_yscale("log")
    b.set_ylabel("span recall (% of the full cache's gain)")
    b.set_ylim(-5, 105)
    a.legend(fontsize=8)
    context = rows[0].get("context")
    fig.suptitle(f"Equal bytes, {context or ''} tokens of context: loss and recall against the byte budget")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
