"""How much of a packed key's rounding error its rows' common mean costs: SmolLM2's post-RoPE keys
(and values) of one text, rotated as the h2o cache stores them, rounded to 4 bits with a scale per
64 values, with no centre, the mean of the first 128 rows (what the cache can know: it fixes its
centre when rows first leave the 8-bit window), and the mean of every row (an oracle). The error is
measured on rows 128 on, relative to the rows' norm; the mean's norm is reported against the rows'.

    python benchmarks/bench_key_centering.py                  # GPL-3, 2048 tokens
    python benchmarks/bench_key_centering.py --tokens 1024 --bits 8
"""

import argparse

import numpy as np


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--bits", type=int, default=4, choices=(2, 4, 8))
    p.add_argument("--group-size", type=int, default=64, choices=(32, 64))
    p.add_argument("--first", type=int, default=128, help="rows the causal centre is the mean of")
    args = p.parse_args(argv)

    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    import mlx_h2o
    from mlx_h2o.storage.rotation import KVRotation

    model, tokenizer = mlx_h2o.load()
    with open(args.text, encoding="utf-8") as f:
        ids = tokenizer.encode(f.read() * 4)[: args.tokens]
    cache = [KVCache() for _ in model.layers]
    mx.eval(model(mx.array([ids]), cache=cache))

    def rounded(x):
        g, b = args.group_size, args.bits
        return mx.dequantize(*mx.quantize(x, group_size=g, bits=b), group_size=g, bits=b)

    errors, ratios = {}, {"keys": [], "values": []}
    for c in cache:
        D = c.keys.shape[-1]
        rotation = KVRotation.seeded(D, c.values.shape[-1], 0)
        for role, rows, rotate in (("keys", c.keys, rotation.keys), ("values", c.values, rotation.values)):
            x = rotate(rows[..., : c.offset, :].astype(mx.float32))
            norm = mx.linalg.norm(x[:, :, args.first :], axis=-1).mean()
            centres = {"none": mx.zeros_like(x[:, :, :1]), f"first {args.first} rows": x[:, :, : args.first].mean(axis=2, keepdims=True),
                       "every row (oracle)": x.mean(axis=2, keepdims=True)}
            ratios[role].append(float(mx.linalg.norm(centres["every row (oracle)"], axis=-1).mean() / norm))
            for name, centre in centres.items():
                err = mx.linalg.norm((rounded(x - centre) + centre - x)[:, :, args.first :], axis=-1).mean() / norm
                errors.setdefault((role, name), []).append(float(err))
    print(f"{args.tokens} tokens of {args.text}, {args.bits}-bit rows, a scale per {args.group_size} values, rotated; "
          f"{len(cache)} layers")
    print("| rows | centre | rounding error / row norm (mean over layers) | min-max over layers |")
    print("|---|---|---|---|")
    for (role, name), v in errors.items():
        print(f"| {role} | {name} | {np.mean(v):.4f} | {min(v):.4f}-{max(v):.4f} |")
    for role, v in ratios.items():
        print(f"{role}: the mean's norm is {min(v):.2f}-{max(v):.2f} of the rows' mean norm")


if __name__ == "__main__":
    main()
