"""Perplexity of a chunked prefill through mlx-lm's RotatingKVCache(max_kv_size, keep=4), with the
sink tokens hidden from most queries of each chunk (mlx-lm 0.32.2's make_mask) and visible to all
(patch 0002 of patches/mlx-lm), against the full cache, on the same tokens in one run.

    python benchmarks/bench_rotating_sinks.py --context 1536 --max-kv-size 256 --chunk 256

Each chunk of the context is fed in one call (as mlx-lm's prefill does); the perplexity is that of
every token after the first chunk, predicted from the logits of its chunk.
"""

import argparse
import math

import mlx_h2o  # isort: skip

mlx_h2o.use_openblas()  # this benchmark opts in: OpenBLAS matmuls, before mlx.core loads

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache, RotatingKVCache


class HiddenSinksRotatingKVCache(RotatingKVCache):
    """make_mask as mlx-lm 0.32.2 builds it for N > 1: a plain window over physical indices."""

    def make_mask(self, N, window_size=None, return_array=False):
        if N == 1:
            return super().make_mask(N, window_size=window_size, return_array=return_array)
        window_size = window_size or self.max_size
        offset = min(self.max_size - 1, self.offset)
        if offset + N > window_size or return_array:
            return create_causal_mask(N, offset, window_size=window_size)
        return "causal"


def sinks_visible():
    """Whether the installed RotatingKVCache shows its sinks to every query (patch 0002)."""
    c = RotatingKVCache(max_size=8, keep=2)
    kv = mx.zeros((1, 1, 20, 4))
    c.update_and_fetch(kv, kv)
    return bool(c.make_mask(4, return_array=True)[:, :2].all().item())


def chunked_nll(model, tokens, make_cache, chunk):
    caches = [make_cache() for _ in model.layers]
    nll = []
    for start in range(0, len(tokens) - 1, chunk):
        x = mx.array(tokens[start:start + chunk])[None]
        logits = model(x, cache=caches)[0].astype(mx.float32)
        targets = mx.array(tokens[start + 1:start + chunk + 1])
        n = targets.shape[0]
        logp = logits[:n] - mx.logsumexp(logits[:n], axis=-1, keepdims=True)
        nll.append(np.array(-mx.take_along_axis(logp, targets[:, None], axis=-1)[:, 0]))
    return np.concatenate(nll)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=1536)
    p.add_argument("--max-kv-size", type=int, default=256)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--keep", type=int, default=4)
    p.add_argument("--text", default="/usr/share/common-licenses/GPL-3", help="a text file of >= --context tokens")
    args = p.parse_args(argv)
    model, tokenizer = mlx_h2o.load()
    with open(args.text, encoding="utf-8") as f:
        tokens = tokenizer.encode(f.read())[: args.context + 1]
    if len(tokens) < args.context + 1:
        raise ValueError(f"--text has {len(tokens)} tokens, fewer than --context + 1")
    M, keep = args.max_kv_size, args.keep
    variants = {"full": KVCache, "rotating, sinks hidden (0.32.2)": lambda: HiddenSinksRotatingKVCache(M, keep)}
    if sinks_visible():
        variants["rotating, sinks visible (patched)"] = lambda: RotatingKVCache(M, keep)
    rows = {}
    for name, make in variants.items():
        nll = chunked_nll(model, tokens, make, args.chunk)
        rows[name] = math.exp(nll[args.chunk - 1:].mean())  # tokens after the first chunk
    print(f"context {args.context}, max_kv_size {M}, keep {keep}, prefill chunks of {args.chunk}; "
          f"perplexity of tokens {args.chunk}..{args.context} ({args.text})")
    print("| cache | PPL | vs full |")
    print("| --- | --- | --- |")
    for name, ppl in rows.items():
        print(f"| {name} | {ppl:.3f} | {100 * (ppl / rows['full'] - 1):+.1f} % |")
    if len(variants) == 2:
        print("(this mlx-lm hides the sinks: install the patched wheel for the third row)")


if __name__ == "__main__":
    main()
