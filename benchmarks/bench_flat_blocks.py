"""Decode speed with llama's decoder blocks as one Python frame (cpu_layers.FlatLlamaBlock, what
`mlx_h2o.load()` switches in) against mlx-lm's own TransformerBlock call, through mlx-lm's
`generate_step` (which builds step t + 1's graph while step t evaluates).

    python benchmarks/bench_flat_blocks.py [--context 512] [--caches full h2o:max_kv_size=256] [--rounds 8] [--steps 128]

One process, one model: for each cache spec the two block classes alternate round by round (the order
flips every round), each round a fresh cache, the same prompt (GPL-3 text) and greedy decoding.
Prints tok/s per round, the medians and their ratio, the median Python time to build a step's graph
(taken inside generate_step, so it includes what the evaluating threads take from it), and whether
both decoded the same tokens (they must: the flat block builds the same ops). `uptime` before and
after: timings on a busy machine are not results.
"""

import argparse
import os
import time

import mlx_h2o  # isort: skip

mlx_h2o.use_openblas()  # prefill's GEMMs; before mlx.core loads

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models import llama

from mlx_h2o import cpu_layers
from mlx_h2o.evaluation.runner import parse_specs


def set_flat(model, flat: bool):
    for block in model.model.layers:
        block.__class__ = cpu_layers._flat_block(llama.TransformerBlock) if flat else llama.TransformerBlock


def decode(model, prompt, spec, steps):
    """(tok/s over `steps` decode steps after the first token, median ms building a step's graph, tokens)."""
    cache = mlx_h2o.make_cache(model, spec.policy, **spec.options)
    build = []
    real_call = type(model).__call__

    def timed(self, *a, **kw):
        t0 = time.perf_counter()
        out = real_call(self, *a, **kw)
        build.append(time.perf_counter() - t0)
        return out

    type(model).__call__ = timed
    try:
        tokens, t0 = [], None
        for i, (token, _) in enumerate(generate_step(prompt, model, max_tokens=steps + 1, prompt_cache=cache,
                                                     sampler=lambda x: mx.argmax(x, axis=-1), prefill_step_size=512)):
            if i == 0:
                t0 = time.perf_counter()
            tokens.append(int(token))
        seconds = time.perf_counter() - t0
    finally:
        type(model).__call__ = real_call
    return steps / seconds, float(np.median(build[-steps:])) * 1e3, tokens


def alternate(model, prompt, spec, args, short: str, arms: dict):
    """Decode with two arms (name -> a function that switches the model to it) alternating round by
    round, the order flipped every round; print each round, then the table and the second arm's
    ratio to the first (medians) under `short`. Leaves the model on the second arm."""
    base, new = arms
    runs, tokens = {base: [], new: []}, {}
    for r in range(args.rounds):
        for name in (base, new) if r % 2 == 0 else (new, base):
            arms[name]()
            tok_s, build_ms, toks = decode(model, prompt, spec, args.steps)
            runs[name].append((tok_s, build_ms))
            tokens.setdefault(name, toks)
        print(f"  round {r + 1}/{args.rounds}: {base} {runs[base][-1][0]:.1f} tok/s, {new} {runs[new][-1][0]:.1f}", flush=True)
    arms[new]()
    med = {name: float(np.median([t for t, _ in v])) for name, v in runs.items()}
    print(f"\n{spec.label}, context {args.context}, {args.steps} steps a round, {args.rounds} rounds")
    print("| arm | tok/s per round | median tok/s | median build ms |")
    print("|---|---|---|---|")
    for name in (base, new):
        per = ", ".join(f"{t:.1f}" for t, _ in runs[name])
        print(f"| {name} | {per} | {med[name]:.1f} | {np.median([b for _, b in runs[name]]):.2f} |")
    wins = sum(a[0] > b[0] for a, b in zip(runs[new], runs[base]))
    print(f"{short} / the other: {med[new] / med[base]:.3f}x (medians; faster in {wins} of {args.rounds} rounds); "
          f"same tokens: {tokens[new] == tokens[base]}")


def run_alternating(description: str, short: str, arms_of):
    """The command line of this benchmark and of those built on it: parse it, load the embedded model,
    make the arms (`arms_of(model)` -> {name: a function that switches the model to it}; the second
    is the one measured against the first) and alternate them for every cache spec."""
    ap = argparse.ArgumentParser(description=description.splitlines()[0])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--caches", nargs="+", default=["full"], metavar="SPEC")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=128)
    args = ap.parse_args()
    try:
        specs = parse_specs(args.caches)
    except ValueError as e:
        ap.error(f"--caches: {e}")
    model, tokenizer = mlx_h2o.load()
    arms = arms_of(model)
    with open("/usr/share/common-licenses/GPL-3", encoding="utf-8") as f:
        prompt = mx.array(tokenizer.encode(f.read() * 4)[: args.context])
    print(f"uptime before: {os.popen('uptime').read().strip()}", flush=True)
    for spec in specs:
        alternate(model, prompt, spec, args, short, arms)
    print(f"uptime after: {os.popen('uptime').read().strip()}")


def flat_arms(model):
    if not isinstance(model.model.layers[0], cpu_layers.FlatLlamaBlock):
        raise SystemExit("the model's blocks are not llama's: nothing to compare")
    return {"mlx-lm's TransformerBlock": lambda: set_flat(model, False), "flat (FlatLlamaBlock)": lambda: set_flat(model, True)}


if __name__ == "__main__":
    run_alternating(__doc__, "flat", flat_arms)
