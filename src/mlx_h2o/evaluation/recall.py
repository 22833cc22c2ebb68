"""Recall probe: a span of real text, unrelated filler, then the same span again.

A cache that still holds the span lets the model copy it (induction heads): the NLL on the repeat
falls far below the NLL of the same text read cold. A sliding window that lost the span cannot
copy. Per policy and budget the probe reports the mean NLL on the repeat and the share of the full
cache's gain the policy recovers,

    recovered = (NLL_window - NLL_policy) / (NLL_window - NLL_full),

with the window (`rotating`) at the same budget: 0 = no better than forgetting the span, 1 = as good
as the full cache. Perplexity under-rewards keeping the middle of a context; this measures it.

Each sequence is `lead + span + filler + span`:
- lead: the LEAD tokens before the span in its document (context for the first occurrence);
- span: S tokens from SPAN_OFFSET tokens into a document (past titles and headers);
- filler: F tokens of the set's other documents joined end to end (from the one half the set
  away on, skipping the span's own), chosen to share no 8-gram with the span (licences quote each
  other), so F may exceed any one document;
- the repeat: the span again. Its first token has no cue that a repeat starts, so the NLL is taken
  over the repeat's tokens 2..S (S - 1 predictions).

Two ways to feed it:
- `chunk=None` (the evaluation protocol): prefill the first `prefill` tokens in one call, then one
  token at a time: every eviction is a decode-time eviction;
- `chunk=C`: everything before the repeat is a prompt fed in chunks of C tokens (mlx-lm's
  prefill_step_size), so a bounded cache evicts between chunks while prefilling (the first
  occurrence sits inside a long prompt); the repeat is then decoded one token at a time.
"""

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np
from tqdm.auto import tqdm

from ..caches import make_cache
from .batched import policy_batch, policy_kv_bytes
from .perplexity import _nll

LEAD = 32
SPAN_OFFSET = 256
NGRAM = 8  # a filler may share no NGRAM-gram with its span


@dataclass
class RecallSequence:
    doc: str  # where the span comes from
    filler_doc: str
    tokens: List[int]
    span: int  # S
    filler: int  # F
    repeat_start: int  # index of the repeat's first token

    @property
    def distance(self) -> int:
        """Tokens from the span's first occurrence to its repeat (start to start)."""
        return self.span + self.filler


def _ngrams(ids: Sequence[int], n: int) -> set:
    return {tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)}


def joined(docs: Sequence[Tuple[str, List[int]]], n: int, separator: Sequence[int] = ()) -> Tuple[List[int], List[str]]:
    """The first n tokens of `docs` joined end to end, `separator` after each (fewer if they hold
    fewer), and the ids of the documents used."""
    out, used = [], []
    for name, ids in docs:
        if len(out) >= n:
            break
        out += (list(ids) + list(separator))[: n - len(out)]
        used.append(name)
    return out, used


def recall_sequences(docs: Sequence[Tuple[str, List[int]]], span: int, filler: int, trials: int) -> List[RecallSequence]:
    """`trials` probe sequences from `docs` [(doc id, token ids)] (e.g. one document set): trial i
    takes its span from docs[i] and its filler from the other documents joined, starting at the first
    one after docs[i + len(docs)//2] (cyclically) whose filler shares no 8-gram with the span."""
    if not 1 <= span:
        raise ValueError(f"span must be >= 1 token, got {span}")
    if filler < 0:
        raise ValueError(f"filler must be >= 0 tokens, got {filler}")
    if not 1 <= trials <= len(docs):
        raise ValueError(f"trials must be in [1, {len(docs)}] for {len(docs)} documents, got {trials}")
    if len(docs) < 2:
        raise ValueError("the recall probe needs at least 2 documents (span and filler come from different ones)")
    out = []
    for i in range(trials):
        name, ids = docs[i]
        if len(ids) < SPAN_OFFSET + span:
            raise ValueError(f"document {name!r} has {len(ids)} tokens: too few for a span of {span} at offset {SPAN_OFFSET}")
        lead, text = ids[SPAN_OFFSET - LEAD : SPAN_OFFSET], ids[SPAN_OFFSET : SPAN_OFFSET + span]
        grams = _ngrams(text, NGRAM)
        for k in range(len(docs)):
            j = (i + len(docs) // 2 + k) % len(docs)
            if j == i:
                continue
            fill, used = joined([docs[m % len(docs)] for m in range(j, j + len(docs)) if m % len(docs) != i], filler)
            if len(fill) == filler and not grams & _ngrams(fill, NGRAM):
                break
        else:
            raise ValueError(f"the set's other documents give no {filler} tokens sharing no {NGRAM}-gram with the span of {name!r}")
        tokens = lead + text + fill + text
        out.append(RecallSequence(name, "+".join(used), tokens, span, filler, LEAD + span + filler))
    return out


def _forward(model, x: mx.array, cache, logits: bool):
    """One model call through `cache`; skips the LM head (a fifth of a small model's step) when the
    logits are not needed, for models whose body is `model.model` (mlx-lm's llama family)."""
    body = getattr(model, "model", None)
    if logits or body is None:
        out = model(x, cache=cache)
    else:
        out = body(x, cache=cache)
    mx.eval(out)
    return out


def feed(model, x: mx.array, cache, end: int, chunk: Optional[int] = None, prefill: int = 32, progress=None) -> None:
    """Feed x[:, :end] through `cache` without logits: chunk=None, the first `prefill` tokens in one
    call, then one token at a time (the perplexity protocol); chunk=C, in calls of C tokens."""
    if chunk is None:
        if not 1 <= prefill <= end:
            raise ValueError(f"prefill must be in [1, {end}], got {prefill}")
        starts = [0] + list(range(prefill, end))
        ends = starts[1:] + [end]
    else:
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        starts = list(range(0, end, chunk))
        ends = [min(s + chunk, end) for s in starts]
    for s, e in zip(starts, ends):
        _forward(model, x[:, s:e], cache, logits=False)
        if progress:
            progress(e - s)


def repeat_nll(model, tokens, cache, repeat_start: int, chunk: Optional[int] = None, prefill: int = 32, progress=None) -> np.ndarray:
    """NLL (B, T - repeat_start - 1) of tokens[:, repeat_start + 1:] through `cache`, fed as the
    module docstring says (chunk=None: prefill then one token at a time; chunk=C: the prompt before
    the repeat in chunks of C, then one token at a time)."""
    x = mx.array(np.asarray(tokens))
    x = x[None] if x.ndim == 1 else x
    T = x.shape[1]
    if not 1 <= repeat_start < T - 1:
        raise ValueError(f"repeat_start must be in [1, {T - 1}) for {T} tokens, got {repeat_start}")
    feed(model, x, cache, repeat_start, chunk, prefill, progress)
    nll = []
    for t in range(repeat_start, T - 1):
        nll.append(_nll(_forward(model, x[:, t : t + 1], cache, logits=True), x[:, t + 1 : t + 2]))
        mx.eval(nll[-1])
        if progress:
            progress(1)
    return np.array(mx.concatenate(nll, axis=1), dtype=np.float64)


def recall_table(model, specs, sequences: Sequence[RecallSequence], chunk: Optional[int] = None, prefill: int = 32,
                 policy_batch_size: Optional[int] = None, progress: bool = True) -> List[dict]:
    """Mean repeat NLL of every spec over the same `sequences` (all of one span and filler length),
    policies decoded together `policy_batch_size` at a time (default: all). Rows carry the per-trial
    NLLs, KV bytes at the end and, once `add_recovered` runs, the share of the full cache's gain."""
    lengths = {(s.span, s.filler, len(s.tokens)) for s in sequences}
    if len(lengths) != 1:
        raise ValueError("recall_table needs sequences of one span and filler length")
    span, filler, T = lengths.pop()
    tokens = np.array([s.tokens for s in sequences], dtype=np.int32)
    n = len(sequences)
    repeat_start = sequences[0].repeat_start
    group = policy_batch_size or len(specs)
    rows = []
    for g in range(0, len(specs), group):
        batch_specs = specs[g : g + group]
        caches = [make_cache(model, s.policy, **s.options) for s in batch_specs]
        batch = policy_batch(caches, n)
        steps = repeat_start + (T - 1 - repeat_start)
        desc = ", ".join(s.label for s in batch_specs)
        with tqdm(total=steps, desc=f"recall S={span} F={filler}: {desc}"[:90], unit="tok", disable=not progress, leave=False) as bar:
            nll = repeat_nll(model, np.concatenate([tokens] * len(batch_specs)), batch, repeat_start, chunk, prefill, bar.update)
        for i, spec in enumerate(batch_specs):
            per_trial = nll[i * n : (i + 1) * n].mean(axis=1)
            rows.append({
                "label": spec.label, "policy": spec.policy, "options": dict(spec.options),
                "max_kv_size": spec.options.get("max_kv_size"), "span": span, "filler": filler,
                "chunk": chunk, "trials": n, "nll": float(per_trial.mean()), "trial_nll": per_trial.tolist(),
                "kv_bytes_per_seq": policy_kv_bytes(batch, i) / n,
                "docs": [s.doc for s in sequences], "filler_docs": [s.filler_doc for s in sequences],
            })
    return add_recovered(rows)


def add_recovered(rows: List[dict], budget=lambda r: r["max_kv_size"], is_window=lambda r: r["policy"] == "rotating") -> List[dict]:
    """Set `recovered` (share of the full cache's gain over the window at the same budget, per the
    module docstring) on every row that has both references with the same span, filler and chunk.
    `budget(row)` says which rows share a budget (default M; suite.py: the fraction of the bytes) and
    `is_window(row)` which row of a budget is the window."""
    key = lambda r: (r.get("span"), r.get("filler"), r.get("chunk"))  # noqa: E731
    full = {key(r): r["nll"] for r in rows if r["policy"] == "full"}
    window = {(*key(r), budget(r)): r["nll"] for r in rows if is_window(r)}
    for r in rows:
        f, w = full.get(key(r)), window.get((*key(r), budget(r)))
        gain = None if f is None or w is None else w - f
        r["recovered"] = None if gain is None or gain <= 0 else (w - r["nll"]) / gain
        r["window_nll"], r["full_nll"] = w, f
    return rows


def recall_markdown(rows: List[dict]) -> str:
    from .report import markdown_table

    def fmt(v, spec):
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)

    return markdown_table(
        ["policy", "span S", "filler F", "feed", "NLL on repeat", "recovered", "KV MB/seq"],
        [
            [r["label"], r["span"], r["filler"], "decode" if r["chunk"] is None else f"chunks of {r['chunk']}",
             f"{r['nll']:.3f}", fmt(r["recovered"] if r["recovered"] is None else 100 * r["recovered"], ".0f") + (" %" if r["recovered"] is not None else ""),
             f"{r['kv_bytes_per_seq'] / 2**20:.2f}"]
            for r in rows
        ],
    )
