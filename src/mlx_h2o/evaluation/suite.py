"""The recall suite: every cache of the same bytes, at a fraction of the full cache's, on three probes
through the cache token by token (the perplexity protocol), each scored as the share of the full
cache's success that survives.

- `needle`: a lexical needle, a decoy, a paraphrased question (retrieval.py);
- `passkey`: a 5-digit key said twice, asked for at the end (retrieval.py);
- `span`: a 64-token span of real text, filler up to the context, the span again: the share of the
  full cache's NLL gain over the fp window of the same bytes (recall.py, `recovered`).

The caches at a budget of B bytes per sequence (`equal_byte_specs`, B = fraction x the full cache's
bytes at the context):
- `window fp`: mlx-lm's RotatingKVCache of B / (full bytes per token) entries;
- `window 8-bit`: a sliding window with sinks at 8 bits (h2o `split=window,kv_bits=8`) of B bytes;
- `h2o`: `max_kv_bytes=B` (the byte rule, caches/h2o/bytes.py: 4-bit rotated rows, the newest 64
  at 8 bits, a quarter of M for heavy hitters, no archive);
- `h2o + archive`: `max_kv_bytes=B` with a 2-bit archive of evicted entries (`evicted_bits=2`,
  cumulative score: the best recall measured on set 0, docs/h2o.md).

The reference and the baselines (the full cache, both windows) keep their rows in the model's dtype
(`{D}` in a template): the protocol every table in docs/h2o.md was measured with. The policies'
default since 2026-11-29 keeps a float32 model's rows in float16 (storage.default_kv_dtype), which
would halve the full cache's bytes, and with them every budget here.
"""

from typing import Dict, List, Optional, Sequence

import mlx.core as mx

from ..caches import make_cache
from ..storage import dtype_name, model_dtype
from .memory import kv_bytes
from .recall import LEAD, add_recovered, recall_sequences, recall_table
from .retrieval import retrieval_table, retrieval_trials
from .runner import PolicySpec, parse_specs

SPAN = 64
# (name in the tables, spec template: {B} is the budget in bytes, {M} the fp window's entries, {D}
# the model's dtype)
CACHES = (
    ("window fp", "rotating:max_kv_size={M},kv_dtype={D}"),
    ("window 8-bit", "h2o:max_kv_bytes={B},split=window,kv_bits=8,kv_dtype={D}"),
    ("h2o", "h2o:max_kv_bytes={B}"),
    ("h2o + archive", "h2o:max_kv_bytes={B},evicted_bits=2,score=cumulative"),
)


def parse_caches(items: Sequence[str]) -> tuple:
    """`NAME=SPEC` items (the CLI's --cache) as (name, template) pairs like CACHES, each template
    checked by parsing it at a budget of 1 MB (a bad policy or option is a ValueError before a
    model loads)."""
    caches = []
    for item in items:
        name, sep, template = (part.strip() for part in item.partition("="))
        if not sep or not name or not template:
            raise ValueError(f"--cache takes NAME=SPEC (e.g. 'h2o=h2o:max_kv_bytes={{B}}'), got {item!r}")
        try:
            parse_specs([template.format(B=10**6, M=64, D="float32")])
        except (KeyError, IndexError) as e:
            raise ValueError(f"--cache {item!r}: only {{B}} (bytes), {{M}} (entries) and {{D}} (the model's dtype) can be "
                             f"filled in, not {e}") from None
        caches.append((name, template))
    if len({n for n, _ in caches}) < len(caches):
        raise ValueError(f"--cache names must differ, got {[n for n, _ in caches]}")
    return tuple(caches)


def check_probes(probes: Sequence[str], caches=CACHES) -> None:
    unknown = set(probes) - {"needle", "passkey", "span"}
    if unknown:
        raise ValueError(f"probes must be among needle, passkey, span; got {sorted(unknown)}")
    if "span" in probes and "window fp" not in {name for name, _ in caches}:
        raise ValueError("the span probe scores against the fp window of the same bytes: add a cache named 'window fp' "
                         f"(e.g. 'window fp={dict(CACHES)['window fp']}') or leave span out of --probes")


def reference_rows(model) -> str:
    """The dtype the protocol's full cache and windows keep rows in: the model's (module docstring)."""
    dtype = model_dtype(model)
    return "float32" if dtype is None else dtype_name(dtype)


def full_bytes_per_token(model) -> int:
    """Bytes one token takes in the reference full cache of every layer (K and V, every kv head, rows
    in the model's dtype), measured by feeding one token."""
    cache = make_cache(model, "full", kv_dtype=reference_rows(model))
    mx.eval(model(mx.array([[0]]), cache=cache))
    return kv_bytes(cache)


def check_fractions(fractions: Sequence[float]) -> None:
    for f in fractions:
        if not 0.0 < f < 1.0:
            raise ValueError(f"budget fractions must lie in (0, 1), got {f}")


def equal_byte_specs(model, context: int, fractions: Sequence[float], caches=CACHES) -> List[PolicySpec]:
    """`full`, then for every fraction every cache of `caches` at fraction x the full cache's bytes at
    `context` tokens; each spec carries its table name and fraction as `name` and `fraction`."""
    token, rows = full_bytes_per_token(model), reference_rows(model)
    full = parse_specs([f"full:kv_dtype={rows}"])[0]
    full.name, full.fraction = "full", 1.0
    specs = [full]
    check_fractions(fractions)
    for f in fractions:
        budget = int(f * context * token)
        for name, template in caches:
            spec = parse_specs([template.format(B=budget, M=max(1, budget // token), D=rows)])[0]
            spec.name, spec.fraction = name, f
            specs.append(spec)
    return specs


def recall_suite(model, tokenizer, docs, contexts: Sequence[int], fractions: Sequence[float], probes=("needle", "passkey", "span"),
                 per_depth: int = 1, span_trials: int = 4, policy_batch_size: Optional[int] = None, progress: bool = True,
                 on_rows=None, caches=CACHES) -> List[dict]:
    """Rows (one per context, probe and cache) with `survived`: the share of the full cache's success
    this cache keeps (retrieval: hits among the full cache's hits; span: `recovered`). `docs` is one
    document set (corpus.document_set); `on_rows(rows)` is called after every probe (partial results);
    `caches` as CACHES (parse_caches)."""
    check_probes(probes, caches)
    rows = []
    for T in contexts:
        specs = equal_byte_specs(model, T, fractions, caches)
        meta = {s.label: {"cache": s.name, "fraction": s.fraction} for s in specs}
        found = [p for p in probes if p != "span"]
        if found:
            trials = retrieval_trials(tokenizer, docs, T, probes=found, per_depth=per_depth)
            rows += _tagged(retrieval_table(model, tokenizer, specs, trials, policy_batch_size=policy_batch_size,
                                            progress=progress), meta)
            if on_rows:
                on_rows(rows)
        if "span" in probes:
            sequences = recall_sequences(docs, SPAN, T - LEAD - 2 * SPAN, span_trials)
            span_rows = _tagged(recall_table(model, specs, sequences, policy_batch_size=policy_batch_size,
                                             progress=progress), meta)
            rows += _span_survived(span_rows, T)
            if on_rows:
                on_rows(rows)
    return rows


def _span_survived(rows: List[dict], context: int) -> List[dict]:
    """The span probe's `survived`: recall.add_recovered's share of the full cache's gain, with the fp
    window of the same fraction (same bytes, not the same M) as the zero; the full cache keeps it all."""
    add_recovered(rows, budget=lambda r: r["fraction"], is_window=lambda r: r["cache"] == "window fp")
    for r in rows:
        if r["cache"] == "full":
            r["recovered"] = 1.0
        r.update(probe="span", context=context, survived=r["recovered"])
    return rows


def _tagged(rows: List[dict], meta: Dict[str, dict]) -> List[dict]:
    for r in rows:
        r.update(meta[r["label"]])
    return rows


def suite_markdown(rows: List[dict]) -> str:
    """One line per (budget, cache), one column per (context, probe): the share of the full cache's
    success that survives; the full cache's line gives its own success (hits or NLL on the repeat)."""
    from .report import markdown_table

    columns = list(dict.fromkeys((r["context"], r["probe"]) for r in rows))
    lines = list(dict.fromkeys((r["fraction"], r["cache"]) for r in rows))
    lines.sort(key=lambda fc: -fc[0])
    cell = {(r["fraction"], r["cache"], r["context"], r["probe"]): r for r in rows}

    def text(r):
        if r is None:
            return "-"
        if r["cache"] == "full":
            return f"NLL {r['nll']:.2f}" if r["probe"] == "span" else f"{sum(r['hits'])}/{r['trials']} hit"
        if r["survived"] is None:
            return "n/a"
        extra = "" if r["probe"] == "span" else f" ({sum(r['hits'])}/{r['trials']})"
        return f"{100 * r['survived']:.0f} %{extra}"

    return markdown_table(
        ["bytes of full", "cache"] + [f"{p} @ {T}" for T, p in columns],
        [[f"{100 * f:.0f} %", c] + [text(cell.get((f, c, T, p))) for T, p in columns] for f, c in lines],
    )
