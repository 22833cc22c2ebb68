"""mlx-h2o: bounded-memory LLM inference for MLX / mlx-lm.

Importing the package changes nothing in MLX or mlx-lm and loads nothing heavy: the names below
are imported on first use. Speed-ups that touch MLX are explicit calls on what you hand them:
`load()` switches the returned model's layers to the CPU kernels (`use_cpu_layer_kernels(model)`
for other models), `use_openblas()` routes MLX's CPU matmuls to OpenBLAS for the process (call it
before anything imports mlx.core, or set MLX_H2O_BLAS=openblas), and `use_mmap_for_large_buffers()`
makes the process return freed large buffers to the system and `limit_mlx_buffer_cache()` keeps MLX
from holding freed ones (a lower peak RSS; the `mlx-h2o` command calls all three for its own process).
"""

import importlib
import os

__version__ = "0.3.0"

# public name -> the module that defines it (imported on first access: PEP 562)
_EXPORTS = {
    "DenseRows": ".attention",
    "PackedKV": ".attention",
    "attention_with_scores": ".attention",
    "quantized_scaled_dot_product_attention_with_scores": ".attention",
    "scaled_dot_product_attention_with_scores": ".attention",
    "POLICIES": ".caches",
    "make_cache": ".caches",
    "use_fast_cpu_attention": ".hook",
    "load": ".loading",
    "quantized_matmul": ".cpu_layers",
    "rms_norm": ".cpu_layers",
    "rope": ".cpu_layers",
    "split_heads_rope": ".cpu_layers",
    "swiglu": ".cpu_layers",
    "use_cpu_layer_kernels": ".cpu_layers",
    "use_default_cpu_kernels": ".cpu_layers",
    "limit_mlx_buffer_cache": "._allocator",
    "use_mmap_for_large_buffers": "._allocator",
    "blas_backend": "._blas",
    "use_openblas": "._blas",
    "_ext": "._native",
}
__all__ = sorted(name for name in _EXPORTS if not name.startswith("_"))


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mlx_h2o' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


# The one opt-in read from the environment: the shim must load before libmlx, so it cannot wait
# for a call when the user's own code imports mlx.core next.
if os.environ.get("MLX_H2O_BLAS") == "openblas":
    from ._blas import use_openblas

    use_openblas()
