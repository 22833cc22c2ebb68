"""Passkey retrieval: a 5-digit number hidden at a chosen depth of a real-text haystack, asked for at
the end of the prompt (chat template), answered by greedy generation through a cache policy.

The whole prompt is prefilled in one call by default (as mlx-lm's generate does for prompts up to
its 2048-token prefill step), so the first answer token still sees the whole context; every later
token sees only what the cache kept. A number is found only if the cache kept the needle.
"""

import random
from dataclasses import dataclass
from typing import List, Optional, Sequence

import mlx.core as mx
from mlx_lm.generate import generate_step
from tqdm.auto import tqdm

from ..caches import make_cache
from .corpus import Corpus

QUESTION = "What is the pass key? Answer with the number only."
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "


@dataclass
class PasskeyTrial:
    doc: str
    depth: float
    key: str
    prompt: List[int]


def passkey_trials(tokenizer, corpus: Corpus, context: int, depths: Sequence[float], per_depth: int, seed: int = 0) -> List[PasskeyTrial]:
    """`per_depth` prompts of about `context` tokens for each depth (0 = start of the haystack, 1 = end),
    each from a different document with its own random key."""
    if context < 128:
        raise ValueError(f"context must be >= 128 tokens, got {context}")
    for d in depths:
        if not 0.0 <= d <= 1.0:
            raise ValueError(f"depths must lie in [0, 1], got {d}")
    rng = random.Random(seed)
    docs = [d for d in corpus.documents if len(d[1]) >= 4 * context]
    rng.shuffle(docs)
    if len(docs) < per_depth:
        raise ValueError(f"only {len(docs)} documents of {corpus.name} are long enough for context={context}; lower per_depth or context")
    trials = []
    for i in range(per_depth):
        name, text = docs[i]
        hay = tokenizer.encode(text)
        for depth in depths:
            key = str(rng.randrange(10000, 100000))
            needle = NEEDLE.format(key=key)
            overhead = len(_chat(tokenizer, needle + "\n\n" + QUESTION))
            n = context - overhead
            if n < 16:
                raise ValueError(f"context={context} leaves no room for a haystack")
            cut = int(depth * n)
            body = tokenizer.decode(hay[:cut]) + needle + tokenizer.decode(hay[cut:n])
            trials.append(PasskeyTrial(name, depth, key, _chat(tokenizer, body + "\n\n" + QUESTION)))
    return trials


def _chat(tokenizer, text: str) -> List[int]:
    if tokenizer.has_chat_template:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))
    return list(tokenizer.encode(text + "\nAnswer:"))


def run_passkey(model, tokenizer, specs, trials: Sequence[PasskeyTrial], max_tokens: int = 12,
                prefill_step_size: Optional[int] = None, progress: bool = True) -> List[dict]:
    """One row per (policy, depth) plus an "all" row per policy: accuracy and the answers given."""
    rows = []
    for spec in specs:
        hits = {}
        for t in tqdm(trials, desc=f"passkey {spec.label}", disable=not progress, leave=False):
            cache = make_cache(model, spec.policy, **spec.options)
            step = prefill_step_size or len(t.prompt)
            out = [tok for tok, _ in generate_step(mx.array(t.prompt), model, max_tokens=max_tokens, prompt_cache=cache, prefill_step_size=step)]
            answer = tokenizer.decode(out)
            hits.setdefault(t.depth, []).append((t.key in answer, answer.strip()))
        for depth in sorted(hits):
            ok = [h for h, _ in hits[depth]]
            rows.append({"label": spec.label, "policy": spec.policy, "options": dict(spec.options), "depth": depth,
                         "trials": len(ok), "accuracy": sum(ok) / len(ok), "answers": [a for _, a in hits[depth]]})
        ok = [h for v in hits.values() for h, _ in v]
        rows.append({"label": spec.label, "policy": spec.policy, "options": dict(spec.options), "depth": "all",
                     "trials": len(ok), "accuracy": sum(ok) / len(ok)})
    return rows


def passkey_markdown(rows: List[dict]) -> str:
    from .report import markdown_table

    depths = [d for d in dict.fromkeys(r["depth"] for r in rows) if d != "all"]
    labels = list(dict.fromkeys(r["label"] for r in rows))
    acc = {(r["label"], r["depth"]): r for r in rows}
    return markdown_table(
        ["policy"] + [f"depth {d:.0%}" for d in depths] + ["all"],
        [[lab] + [f"{acc[lab, d]['accuracy']:.0%}" for d in depths] + [f"{acc[lab, 'all']['accuracy']:.0%} ({acc[lab, 'all']['trials']})"] for lab in labels],
    )
