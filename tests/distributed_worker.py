"""One rank of the distributed test (tests/test_distributed.py starts it under `mlx.launch`, or alone
as the one-rank reference): the embedded model or a tiny quantized llama with 3 kv heads, tensor parallel (`--mode tensor`), pipelined
(`--mode pipeline`) or whole (`--mode single`), and for each cache case:

- the per-token NLL of a licence text (random tokens for the tiny model) through the cache, with
  MLX's own quantized matmul: mlx-h2o's CPU kernel rounds activations to int8, which turns the
  last-bit differences of an all-reduce's summation order into int8 rounding flips (±0.7 % PPL over
  96 tokens of SmolLM2, as much as the kernel's own difference from the exact matmul), so the
  equivalence is checked exactly and the kernels in their own case, `full-int8` (a prefill, then one token a call);
- the positions every h2o layer holds afterwards, and the cache's bytes on this rank;
- the cache saved on this rank, then `--greedy` greedy tokens from the live cache and from the file
  loaded back, which must be the same;
- the file loaded into another rank's process must fail with a clear error (checked by rank 1).

Writes {case: results} to OUT/rank{r}.json.
"""

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

import mlx_h2o
from mlx_h2o import make_cache
from mlx_h2o.caches.h2o import H2OKVCache
from mlx_h2o.cpu_layers import _STOCK_CLASSES
from mlx_h2o.distributed import pipeline, shard

# name -> (policy, options): every policy, h2o per head and per layer (shared selection), and the h2o
# parts whose choices the heads share (adaptive heads, dispersion) or that keep evicted entries.
CASES = {
    "full": ("full", {}),
    "full-int8": ("full", {}),  # with the CPU layer kernels (the sharded ones under tensor parallelism)
    "quantized": ("quantized", {"bits": 8}),
    "rotated": ("rotated", {"bits": 4}),
    "reserved": ("reserved", {"max_context": 4096}),
    "rotating": ("rotating", {"max_kv_size": 64}),
    "h2o-head": ("h2o", {"max_kv_size": 48}),
    "h2o-layer": ("h2o", {"max_kv_size": 48, "select": "layer"}),
    "h2o-adaptive": ("h2o", {"max_kv_size": 48, "head_budget": "adaptive"}),
    "h2o-dispersion": ("h2o", {"max_kv_size": 48, "layer_budget": "dispersion", "select": "layer"}),
    "h2o-archive": ("h2o", {"max_kv_size": 48, "evicted_bits": 2, "kv_bits": 8}),
    "h2o-bytes": ("h2o", {}),  # max_kv_bytes: BYTE_BUDGETS, small enough that both models evict within the run
}
BYTE_BUDGETS = {"embedded": 440_000, "tiny": 60_000}


# A llama small enough that 3 ranks on 2 cores decode it in a test (each layer all-reduces twice):
# 6 query and 3 kv heads of 64, quantized at 4 bits in groups of 32 like the embedded model's layers.
TINY = dict(hidden_size=384, num_attention_heads=6, num_key_value_heads=3, intermediate_size=768, vocab_size=256)


def load_model(name: str):
    """(model, token ids to run): the embedded SmolLM2 and a licence text, or the tiny llama and
    random tokens."""
    if name == "embedded":
        model, tokenizer = mlx_h2o.load(cpu_kernels=False)
        with open("/usr/share/common-licenses/GPL-3", encoding="utf-8") as f:
            return model, tokenizer.encode(f.read())
    from tiny_models import tiny_model

    model = tiny_model("llama", **TINY)
    nn.quantize(model, group_size=32, bits=4)
    return model, np.random.default_rng(0).integers(0, TINY["vocab_size"], 4096).tolist()


class Nudged(nn.Module):
    """A layer whose output is scaled by 1 + eps: a last-bits perturbation of the residual stream, the
    size of an all-reduce's reordering, to measure how much a cache's result moves by it alone."""

    def __init__(self, inner, eps: float):
        super().__init__()
        self.inner, self.eps = inner, eps

    def __call__(self, x):
        return self.inner(x) * (1 + self.eps)


def held_positions(caches):
    """Per layer, the positions each h2o lane holds ((B, H, n) lists), or None (not h2o, or another
    rank's layer)."""
    return [[np.array(lane.store.column("pos")).tolist() for lane in c.lanes]
            if isinstance(c, H2OKVCache) and c.lanes is not None else None for c in caches]


def nll_through(model, caches, ids, prefill):
    """Per-token NLL of ids[prefill:] given everything before, through the caches: a prefill, then
    one token a call."""
    x = mx.array(ids)[None]
    logits = model(x[:, :prefill], cache=caches)
    nll = [_nll(logits[0, -1], ids[prefill])]
    for i in range(prefill, len(ids) - 1):
        nll.append(_nll(model(x[:, i : i + 1], cache=caches)[0, -1], ids[i + 1]))
    return nll


def _nll(logits, target):
    logits = logits.astype(mx.float32)
    return float((mx.logsumexp(logits) - logits[target]).item())


def greedy(model, caches, token, steps):
    out = []
    for _ in range(steps):
        token = int(mx.argmax(model(mx.array([[token]]), cache=caches)[0, -1]).item())
        out.append(token)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("single", "tensor", "pipeline"), required=True)
    p.add_argument("--model", choices=("embedded", "tiny"), default="embedded")
    p.add_argument("--out", required=True)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--tokens", type=int, default=160)
    p.add_argument("--prefill", type=int, default=32)
    p.add_argument("--greedy", type=int, default=8)
    p.add_argument("--nudge", type=float, default=0.0, help="one rank: scale every o_proj output by 1 + NUDGE (the noise floor)")
    args = p.parse_args()

    group = mx.distributed.init()
    rank = group.rank()
    model, ids = load_model(args.model)
    ids = ids[: args.tokens]
    if args.nudge:
        for layer in model.layers:
            layer.self_attn.o_proj = Nudged(layer.self_attn.o_proj, args.nudge)
    if args.mode == "tensor":
        shard(model, group)
    elif args.mode == "pipeline":
        pipeline(model, group)
    out_dir = Path(args.out)
    results = {}
    for name in args.cases.split(","):
        policy, options = CASES[name]
        mlx_h2o.use_cpu_layer_kernels(model, enabled=name.endswith("-int8"))
        if name == "h2o-bytes":
            options = {"max_kv_bytes": BYTE_BUDGETS[args.model]}
        caches = make_cache(model, policy, **options)
        start = time.perf_counter()
        nll = nll_through(model, caches, ids, args.prefill)
        seconds = time.perf_counter() - start
        saved = out_dir / f"{name}.rank{rank}.safetensors"
        save_prompt_cache(str(saved), caches)
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group))  # every rank's file is written
        live = greedy(model, caches, ids[-1], args.greedy)
        loaded = greedy(model, load_prompt_cache(str(saved)), ids[-1], args.greedy)
        foreign_error = None
        if group.size() > 1 and rank == 1:
            try:
                load_prompt_cache(str(out_dir / f"{name}.rank0.safetensors"))
            except ValueError as e:
                foreign_error = str(e)
        results[name] = {
            "nll": nll,
            "positions": held_positions(caches),
            "kv_bytes": sum(c.nbytes for c in caches),
            "greedy": live,
            "greedy_after_load": loaded,
            "foreign_error": foreign_error,
            "seconds": seconds,
            "kernel_classes": sorted({type(m).__name__ for _, m in model.named_modules() if type(m) in _STOCK_CLASSES}),
        }
        print(f"rank {rank}: {name} mean NLL {np.mean(nll):.4f} in {seconds:.1f} s", flush=True)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
