"""mlx-h2o: bounded-memory LLM inference for MLX / mlx-lm.

Import order matters: mlx.core must be loaded before the C++ extension that links against libmlx.
"""

from ._blas import blas_backend, route_matmul_to_openblas

route_matmul_to_openblas()  # must run before libmlx is loaded (see _blas.py)

import mlx.core as mx  # noqa: E402,F401  (loads libmlx before the extension)

from . import _ext
from ._version_check import check_extension

check_extension(_ext.built_with_mlx)

from .attention import (  # noqa: E402
    PackedKV,
    attention_with_scores,
    quantized_scaled_dot_product_attention_with_scores,
    scaled_dot_product_attention_with_scores,
)
from .caches import POLICIES, make_cache  # noqa: E402
from .hook import use_fast_cpu_attention  # noqa: E402
from .loading import load  # noqa: E402
from .cpu_layers import quantized_matmul, rms_norm, rope, use_cpu_layer_kernels  # noqa: E402
from .cpu_layers import _enable_by_default as _enable_cpu_layer_kernels  # noqa: E402

_enable_cpu_layer_kernels()  # nn.QuantizedLinear / RMSNorm / RoPE on CPU streams -> our kernels (opt out: cpu_layers.py)

__version__ = "0.2.0"
__all__ = [
    "PackedKV",
    "attention_with_scores",
    "blas_backend",
    "load",
    "make_cache",
    "POLICIES",
    "quantized_matmul",
    "quantized_scaled_dot_product_attention_with_scores",
    "rms_norm",
    "rope",
    "scaled_dot_product_attention_with_scores",
    "use_cpu_layer_kernels",
    "use_fast_cpu_attention",
]
