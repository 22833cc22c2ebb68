"""`python -m mlx_h2o.run_mlx_lm COMMAND ARGS...`: an mlx-lm command (generate, chat, server,
cache_prompt, ...) with mlx-h2o imported first, so that on Linux MLX's CPU matmuls run on NumPy's
OpenBLAS (see _blas.py: the shim must load before libmlx; the mlx-cpu wheel's own BLAS is a
reference one, ~5x slower on a SmolLM2 prefill). Everything else is mlx-lm's own command:

    python -m mlx_h2o.run_mlx_lm server --model DIR --kv-policy h2o --kv-option max_kv_size=512
"""

import mlx_h2o  # noqa: F401  isort: skip  (before mlx.core: the BLAS shim)

import runpy
import sys


def main() -> None:
    sys.argv = ["mlx_lm", *sys.argv[1:]]
    runpy.run_module("mlx_lm", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
