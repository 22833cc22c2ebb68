"""Where a prefill chunk's transient memory comes from: MLX's peak above its active memory for one
layer's attention and MLP evaluated alone, against the whole chunk's lazy graph evaluated at once (as
mlx-lm's generate_step does, and its caches leave it) and layer by layer (as mlx-h2o's caches evaluate
it, caches/base.py's LayerByLayerPrefill). The embedded model, the first --tokens of bench_peer's
prompt, a full cache.

    python benchmarks/trace_prefill_memory.py [--tokens 511] [--layers 3]

Run it under each path's python (stock: PYTHONPATH=src; fork: build/venv-fork/bin/python) to compare.
"""

import argparse

import mlx_h2o


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=511, help="the chunk (bench_peer's 512-token prompt less the step's token)")
    ap.add_argument("--layers", type=int, default=3, help="layers traced one component at a time")
    args = ap.parse_args()
    mlx_h2o.use_openblas()  # before mlx.core loads, as bench_peer.py
    import mlx.core as mx
    from mlx_lm.models.base import create_attention_mask

    from bench_peer import prompt_tokens

    tokens = mx.array(prompt_tokens(2048)[: args.tokens])[None]
    model, _ = mlx_h2o.load()
    inner = model.model
    print(f"MLX {mx.__version__}; block {type(inner.layers[0]).__name__}, "
          f"q_proj {type(inner.layers[0].self_attn.q_proj).__name__}")

    def peak_above_active(fn):
        """(fn()'s evaluated result, MLX's peak above the active memory before it, MiB)."""
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        out = fn()
        mx.eval(out)
        return out, (mx.get_peak_memory() - base) / 2**20

    cache = mlx_h2o.make_cache(model, "full")
    x = inner.embed_tokens(tokens)
    mx.eval(x)
    mask = create_attention_mask(x, cache[0])
    for i, layer in enumerate(inner.layers[: args.layers]):
        h = layer.input_layernorm(x)
        a, attention = peak_above_active(lambda: layer.self_attn(h, mask, cache[i]))
        h = layer.post_attention_layernorm(x + a)
        m, mlp = peak_above_active(lambda: layer.mlp(h))
        x = x + a + m
        mx.eval(x)
        print(f"layer {i}: attention +{attention:.1f} MiB, MLP +{mlp:.1f} MiB")

    from mlx_h2o.caches import base as caches_base

    evaluated_from = caches_base.PREFILL_EVAL_ROWS
    for how, rows in (("all at once, as mlx-lm's caches leave it", 1 << 30), ("layer by layer, as mlx-h2o's caches do", evaluated_from)):
        caches_base.PREFILL_EVAL_ROWS = rows
        cache = mlx_h2o.make_cache(model, "full")
        mx.clear_cache()
        base = mx.get_active_memory()
        _, whole = peak_above_active(lambda: (model(tokens, cache=cache), [c.state for c in cache])[1])
        print(f"the whole chunk's graph (cache states evaluated) {how}: +{whole:.1f} MiB at its peak, "
              f"+{(mx.get_active_memory() - base) / 2**20:.1f} MiB kept (the K/V)")
        del cache
    caches_base.PREFILL_EVAL_ROWS = evaluated_from


if __name__ == "__main__":
    main()
