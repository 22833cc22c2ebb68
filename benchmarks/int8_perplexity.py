"""Teacher-forced perplexity of the packed SmolLM2 with every matmul row through the int8-activation
kernel vs dequantize + GEMM (exact), per licence text and over all of them (docs/cpu-decode.md)."""

import argparse

import numpy as np

import mlx_h2o
from mlx_h2o import cpu_layers
from mlx_h2o.evaluation import teacher_forced_nll

TEXTS = ("Apache-2.0", "GPL-3", "MPL-2.0", "Artistic", "LGPL-2.1", "GFDL-1.3")


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=512, help="tokens per text (default 512)")
    args = ap.parse_args()
    model, tokenizer = mlx_h2o.load(weights="quantized")
    paths = {"int8 kernel": 1 << 30, "dequantize + GEMM": 0}
    total = {p: [] for p in paths}
    print("| text | dequantize + GEMM | int8 kernel | cost |\n|---|---|---|---|")
    for name in TEXTS:
        with open(f"/usr/share/common-licenses/{name}", encoding="utf-8") as f:
            tokens = tokenizer.encode(f.read())[: args.tokens]
        ppl = {}
        for path, max_rows in paths.items():
            cpu_layers.KERNEL_MAX_ROWS = max_rows
            nll = np.asarray(teacher_forced_nll(model, tokens))
            total[path].append(nll)
            ppl[path] = float(np.exp(nll.mean()))
        exact, int8 = ppl["dequantize + GEMM"], ppl["int8 kernel"]
        print(f"| {name} | {exact:.4f} | {int8:.4f} | {100 * (int8 / exact - 1):+.2f} % |")
    exact, int8 = (float(np.exp(np.concatenate(total[p]).mean())) for p in ("dequantize + GEMM", "int8 kernel"))
    print(f"| all | {exact:.4f} | {int8:.4f} | {100 * (int8 / exact - 1):+.2f} % |")


if __name__ == "__main__":
    main()
