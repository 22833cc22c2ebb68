"""`python -m mlx_h2o.run_mlx_lm COMMAND ARGS...`: an mlx-lm command (generate, chat, server,
cache_prompt, ...) sped up on stock MLX, for this process only: MLX's CPU matmuls on NumPy's OpenBLAS
(`use_openblas()`: the mlx-cpu wheel's own BLAS is a reference one, ~5x slower on a SmolLM2 prefill),
freed large buffers returned to the system (`use_mmap_for_large_buffers()`, `limit_mlx_buffer_cache()`,
as the `mlx-h2o` command does; MLX_H2O_ALLOCATOR=glibc opts out), and every model mlx-lm loads switched to mlx-h2o's CPU layer
kernels (`use_default_cpu_kernels`).
Everything else is mlx-lm's own command:

    python -m mlx_h2o.run_mlx_lm server --model DIR --kv-policy h2o --kv-option max_kv_size=512

On the fork's MLX wheel (`scripts/series.py build mlx`) mlx-lm's own entry points get the norm, RoPE,
quantized-layer and attention kernels from MLX itself; this wrapper then adds the SwiGLU activation
kernel only (cpu_layers.SWIGLU_MLPS), which MLX has no op for.
"""

import runpy
import sys

from ._allocator import limit_mlx_buffer_cache, use_mmap_for_large_buffers
from ._blas import use_openblas


def _with_layer_kernels(load_model):
    from .cpu_layers import use_default_cpu_kernels

    def load(*args, **kwargs):
        model, *rest = load_model(*args, **kwargs)
        use_default_cpu_kernels(model)
        return (model, *rest)

    return load


def main() -> None:
    use_openblas()  # before mlx-lm imports mlx.core
    use_mmap_for_large_buffers()
    limit_mlx_buffer_cache()
    import mlx_lm.utils

    # mlx-lm's load / sharded_load call load_model through the module: every model they return;
    # sharded_load then shards it (stock sharded layers), so its result is switched again. Off the CPU
    # the switch does nothing (use_default_cpu_kernels).
    mlx_lm.utils.load_model = _with_layer_kernels(mlx_lm.utils.load_model)
    mlx_lm.utils.sharded_load = _with_layer_kernels(mlx_lm.utils.sharded_load)
    sys.argv = ["mlx_lm", *sys.argv[1:]]
    runpy.run_module("mlx_lm", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
