"""Retrieval probes: a fact hidden in real text, asked for at the end, answered by greedy decoding
through a cache that was fed the whole prompt token by token (the perplexity protocol: `prefill`
tokens in one call, then one at a time), so every eviction happens before the question is seen.

Two probes, each a prompt of exactly `context` tokens (so every trial and policy shares one batch):
- `needle`: a lexical needle ("The blue train leaves from platform 4721."), a decoy of the same
  form with another number at another depth ("The red train leaves from platform 8390."), and a
  paraphrased question that shares few words with the needle ("From which platform does the blue
  train depart?"). A hit is the needle's number in the answer and not the decoy's.
- `passkey`: passkey.py's needle and question (a 5-digit key said twice), no decoy.

The haystack is the documents of one set (corpus.document_set) joined end to end from the trial's
document on, so contexts longer than any single document work. The needle goes in at a sentence
boundary near its depth (the first token after a '.' or a newline, within 64 tokens).

A policy's score is `survived`: of the trials the full cache answers, the share this policy
answers too (1 = everything the full cache finds, 0 = nothing). Trials the full cache misses say
nothing about the cache and are left out of it (their accuracy is reported beside it).
"""

import random
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np
from tqdm.auto import tqdm

from ..caches import make_cache
from .batched import policy_batch, policy_kv_bytes
from .passkey import NEEDLE as PASSKEY_NEEDLE
from .passkey import QUESTION as PASSKEY_QUESTION
from .recall import _forward, feed, joined

# (needle, decoy, paraphrased question): the question names the needle's thing in other words.
NEEDLES = (
    ("The blue train leaves from platform {v}.", "The red train leaves from platform {d}.",
     "From which platform does the blue train depart?"),
    ("Maria keeps her spare key in locker number {v}.", "Her brother keeps his spare key in locker number {d}.",
     "Which locker holds Maria's extra key?"),
    ("The access code for the north gate is {v}.", "The access code for the south gate is {d}.",
     "What number opens the northern entrance?"),
    ("The museum's oldest coin was minted in the year {v}.", "The museum's newest coin was minted in the year {d}.",
     "When was the most ancient coin in the museum made?"),
)
ANSWER_HINT = " Answer with the number only."
DEPTHS = (0.25, 0.5, 0.75)
BOUNDARY_SEARCH = 64  # tokens to look ahead for a sentence boundary


@dataclass
class RetrievalTrial:
    probe: str  # "needle" or "passkey"
    doc: str
    depth: float
    answer: str
    decoy: Optional[str]
    prompt: List[int]  # exactly the context's length


def _chat_frame(tokenizer, question: str) -> Tuple[List[int], List[int]]:
    """Token ids before and after the user's text: the chat template around `text + question`."""
    if not tokenizer.has_chat_template:
        return [], list(tokenizer.encode("\n\n" + question + "\nAnswer:", add_special_tokens=False))
    marker = "\u00a7\u00a7HAYSTACK\u00a7\u00a7"
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": marker + "\n\n" + question}],
                                             add_generation_prompt=True, tokenize=False)
    before, after = rendered.split(marker)
    return (list(tokenizer.encode(before, add_special_tokens=False)),
            list(tokenizer.encode(after, add_special_tokens=False)))


def _boundary(tokenizer, hay: Sequence[int], at: int, limit: int) -> int:
    """The first index >= at (and < limit) right after a token ending a sentence or a line."""
    for i in range(at, min(at + BOUNDARY_SEARCH, limit)):
        if i > 0 and tokenizer.decode([hay[i - 1]]).rstrip(" ").endswith((".", "\n")):
            return i
    return at


def _haystack(docs, start: int, n: int, separator: List[int]) -> List[int]:
    """n tokens: the set's documents joined from docs[start] on (cyclically)."""
    out, _ = joined([docs[(start + k) % len(docs)] for k in range(len(docs))], n, separator)
    if len(out) < n:
        raise ValueError(f"the document set holds {len(out)} tokens: too few for a haystack of {n}")
    return out


def retrieval_trials(tokenizer, docs: Sequence[Tuple[str, List[int]]], context: int, probes=("needle", "passkey"),
                     depths: Sequence[float] = DEPTHS, per_depth: int = 2, seed: int = 0) -> List[RetrievalTrial]:
    """For every probe, `per_depth` trials at each depth, trial j from docs[j] (documents of one set:
    (id, token ids)), each prompt exactly `context` tokens."""
    if context < 256:
        raise ValueError(f"context must be >= 256 tokens, got {context}")
    if not 1 <= per_depth <= len(docs):
        raise ValueError(f"per_depth must be in [1, {len(docs)}] for {len(docs)} documents, got {per_depth}")
    for d in depths:
        if not 0.0 <= d <= 1.0:
            raise ValueError(f"depths must lie in [0, 1], got {d}")
    unknown = set(probes) - {"needle", "passkey"}
    if unknown:
        raise ValueError(f"probes must be 'needle' and/or 'passkey', got {sorted(unknown)}")
    rng = random.Random(seed)
    separator = list(tokenizer.encode("\n\n", add_special_tokens=False))
    encode = lambda s: list(tokenizer.encode(s, add_special_tokens=False))  # noqa: E731
    trials = []
    for probe in probes:
        for j in range(per_depth):
            for depth in depths:
                if probe == "needle":
                    needle, decoy, question = NEEDLES[len(trials) % len(NEEDLES)]
                    value, other = rng.sample(range(1000, 10000), 2)
                    pieces = [(depth, encode(" " + needle.format(v=value) + " ")),
                              ((depth + 0.5) % 1.0, encode(" " + decoy.format(d=other) + " "))]
                    answer, wrong, question = str(value), str(other), question + ANSWER_HINT
                else:
                    key = rng.randrange(10000, 100000)
                    pieces, question = [(depth, encode(PASSKEY_NEEDLE.format(key=key)))], PASSKEY_QUESTION
                    answer, wrong = str(key), None
                before, after = _chat_frame(tokenizer, question)
                n = context - len(before) - len(after) - sum(len(p) for _, p in pieces)
                if n < 64:
                    raise ValueError(f"context={context} leaves no room for a haystack")
                hay = _haystack(docs, j, n, separator)
                body, last = [], 0
                for d, piece in sorted(pieces, key=lambda p: p[0]):
                    cut = _boundary(tokenizer, hay, max(last, int(d * n)), n)
                    body += hay[last:cut] + piece
                    last = cut
                prompt = before + body + hay[last:] + after
                assert len(prompt) == context, (len(prompt), context)
                trials.append(RetrievalTrial(probe, docs[j][0], depth, answer, wrong, prompt))
    return trials


def answer_hit(trial: RetrievalTrial, answer: str) -> bool:
    return trial.answer in answer and (trial.decoy is None or trial.decoy not in answer)


def greedy_answers(model, prompts: np.ndarray, cache, max_tokens: int = 16, prefill: int = 32, progress=None) -> np.ndarray:
    """(B, max_tokens) greedy tokens after `prompts` (B, T), fed through `cache` by the perplexity
    protocol (the first `prefill` tokens in one call, then one token at a time)."""
    x = mx.array(prompts)
    T = x.shape[1]
    feed(model, x, cache, T - 1, prefill=prefill, progress=progress)  # the last prompt token gives the first answer
    token, out = x[:, T - 1 : T], []
    for _ in range(max_tokens):
        token = mx.argmax(_forward(model, token, cache, logits=True)[:, -1, :], axis=-1)[:, None]
        out.append(token)
        if progress:
            progress(1)
    return np.array(mx.concatenate(out, axis=1))


def _answer_text(tokenizer, ids: List[int]) -> str:
    """The answer up to its first end-of-sequence token (rows of a batch run on past their own end)."""
    ends = set(getattr(tokenizer, "eos_token_ids", None) or [tokenizer.eos_token_id])
    cut = next((k for k, t in enumerate(ids) if t in ends), len(ids))
    return tokenizer.decode(ids[:cut])


def retrieval_table(model, tokenizer, specs, trials: Sequence[RetrievalTrial], max_tokens: int = 16, prefill: int = 32,
                    policy_batch_size: Optional[int] = None, progress: bool = True) -> List[dict]:
    """One row per (policy, probe): accuracy, per-trial hits and answers, KV bytes at the end; then
    `survived` against the full cache (add_survived)."""
    lengths = {len(t.prompt) for t in trials}
    if len(lengths) != 1:
        raise ValueError("retrieval_table needs trials of one context length")
    T = lengths.pop()
    prompts = np.array([t.prompt for t in trials], dtype=np.int32)
    n = len(trials)
    group = policy_batch_size or len(specs)
    rows = []
    for g in range(0, len(specs), group):
        batch_specs = specs[g : g + group]
        batch = policy_batch([make_cache(model, s.policy, **s.options) for s in batch_specs], n)
        desc = f"retrieval T={T}: " + ", ".join(s.label for s in batch_specs)
        with tqdm(total=T - 1 + max_tokens, desc=desc[:90], unit="tok", disable=not progress, leave=False) as bar:
            tokens = greedy_answers(model, np.concatenate([prompts] * len(batch_specs)), batch, max_tokens, prefill, bar.update)
        for i, spec in enumerate(batch_specs):
            answers = [_answer_text(tokenizer, a.tolist()) for a in tokens[i * n : (i + 1) * n]]
            for probe in dict.fromkeys(t.probe for t in trials):
                idx = [k for k, t in enumerate(trials) if t.probe == probe]
                hits = [answer_hit(trials[k], answers[k]) for k in idx]
                rows.append({
                    "label": spec.label, "policy": spec.policy, "options": dict(spec.options), "probe": probe,
                    "context": T, "trials": len(idx), "accuracy": sum(hits) / len(idx), "hits": hits,
                    "answers": [answers[k].strip() for k in idx], "depths": [trials[k].depth for k in idx],
                    "docs": [trials[k].doc for k in idx], "kv_bytes_per_seq": policy_kv_bytes(batch, i) / n,
                })
    return add_survived(rows)


def add_survived(rows: List[dict]) -> List[dict]:
    """`survived` on every row: the share of the full cache's hits (same probe and context) that this
    row also hits; None where the full cache hit nothing or is not among the rows."""
    full = {(r["probe"], r["context"]): r["hits"] for r in rows if r["policy"] == "full"}
    for r in rows:
        ref = full.get((r["probe"], r["context"]))
        found = None if ref is None else [h for h, f in zip(r["hits"], ref) if f]
        r["full_hits"] = None if ref is None else sum(ref)
        r["survived"] = (sum(found) / len(found)) if found else None
    return rows
