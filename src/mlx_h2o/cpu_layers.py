"""CPU kernels for the layers of every mlx-lm model, switched in with no model edits:

- `quantized_matmul` for `nn.QuantizedLinear` and `nn.QuantizedEmbedding.as_linear` (the tied lm_head);
- `rms_norm` for `nn.RMSNorm` and `rope` for `nn.RoPE` (integer offsets): on the CPU MLX runs its fast
  ops as composed fallbacks, 11 and 29 primitives a call, two of each per layer: most of a decode
  step's primitives, each paying dispatch. Here each is one primitive.

Decode is a matrix-vector product per layer: MLX's CPU `quantized_matmul` unpacks every weight to a
float first, and dequantized float32 weights move 4x the bytes. The kernel (csrc/kernels/
quantized_matmul_cpu_impl.h) quantizes each row of x once to int8 per 32 values and dots it with the
packed 4-bit / 8-bit weights in integer arithmetic (AVX2 maddubs/madd where the CPU has it), threads
over output columns. Up to 8 rows of x (decode, small batches) take the kernel; longer inputs
(prefill) dequantize and multiply with a BLAS GEMM.

On by default once `mlx_h2o` is imported, for CPU streams only (and for quantized layers: affine mode,
bits 4/8, groups 32/64/128); anything else keeps MLX's own code. Opt out with
`use_cpu_layer_kernels(False)` or the environment variable MLX_H2O_CPU_LAYERS=0.
"""

import os
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from . import _ext

KERNEL_BITS = (4, 8)
KERNEL_GROUP_SIZES = (32, 64, 128)
# Rows of x up to which the layers take the integer-dot kernel (decode, small batches); longer inputs
# dequantize + GEMM. A module setting so that a test can push whole prompts through the kernel.
KERNEL_MAX_ROWS = 8


def quantized_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    *,
    group_size: int,
    bits: int,
    max_rows: Optional[int] = None,
    stream=None,
) -> mx.array:
    """x @ W^T for W = (w, scales, biases) as `mx.quantize(W, group_size, bits)` returns it, like
    `mx.quantized_matmul(..., transpose=True)`. x: (..., K) float32/float16/bfloat16; bits 4 or 8;
    group_size 32, 64 or 128. CPU streams run the integer-dot kernel when x has at most `max_rows`
    rows (default 8), else dequantize + matmul (also what other streams run). The kernel rounds x to
    int8 per 32 values: relative error ~ 1 / 254 of each block's largest |x| per term."""
    for name, v in (("group_size", group_size), ("bits", bits)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{name} must be an integer, got {v!r}")
    if max_rows is not None and (isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 0):
        raise ValueError(f"max_rows must be None or an integer >= 0, got {max_rows!r}")
    return _ext.quantized_matmul(x, w, scales, biases, group_size, bits, -1 if max_rows is None else max_rows, stream)


def _kernel_handles(layer) -> bool:
    return (
        getattr(layer, "mode", "affine") == "affine"
        and layer.bits in KERNEL_BITS
        and layer.group_size in KERNEL_GROUP_SIZES
        and "biases" in layer
        and _on_cpu()
    )


def rms_norm(x: mx.array, weight: Optional[mx.array], eps: float, *, stream=None) -> mx.array:
    """`mx.fast.rms_norm(x, weight, eps)`, one kernel on CPU streams (float32 math, rounded once)."""
    return _ext.rms_norm(x, weight, float(eps), stream)


def rope(x: mx.array, dims: int, *, traditional: bool, base: float, scale: float, offset: int, stream=None) -> mx.array:
    """`mx.fast.rope(x, dims, ...)` for an integer offset, one kernel on CPU streams (angles in float64)."""
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise ValueError(f"offset must be an integer (use mx.fast.rope for array offsets), got {offset!r}")
    return _ext.rope(x, int(dims), bool(traditional), float(base), float(scale), offset, stream)


def _on_cpu() -> bool:
    return mx.default_device() == mx.cpu


def _rms_norm_call(self, x):
    if not _on_cpu():
        return _stock["RMSNorm.__call__"](self, x)
    return _ext.rms_norm(x, self["weight"], self.eps, None)


def _rope_call(self, x, offset: int = 0):
    if not _on_cpu() or not isinstance(offset, int) or x.ndim not in (3, 4):
        return _stock["RoPE.__call__"](self, x, offset)
    return _ext.rope(x, self.dims, self.traditional, self.base, self.scale, offset, None)


def _linear_call(self, x):
    if not _kernel_handles(self):
        return _stock["QuantizedLinear.__call__"](self, x)
    y = _ext.quantized_matmul(x, self["weight"], self["scales"], self["biases"], self.group_size, self.bits, KERNEL_MAX_ROWS, None)
    if "bias" in self:
        y = y + self["bias"]
    return y


def _embedding_as_linear(self, x):
    if not _kernel_handles(self):
        return _stock["QuantizedEmbedding.as_linear"](self, x)
    return _ext.quantized_matmul(x, self["weight"], self["scales"], self["biases"], self.group_size, self.bits, KERNEL_MAX_ROWS, None)


# (class, method) -> ours; _stock keeps MLX's.
_ours = {
    (nn.QuantizedLinear, "__call__"): _linear_call,
    (nn.QuantizedEmbedding, "as_linear"): _embedding_as_linear,
    (nn.RMSNorm, "__call__"): _rms_norm_call,
    (nn.RoPE, "__call__"): _rope_call,
}
_stock_methods = {key: getattr(*key) for key in _ours}
_stock = {f"{cls.__name__}.{method}": f for (cls, method), f in _stock_methods.items()}


def use_cpu_layer_kernels(enabled: bool = True) -> None:
    """Route nn.QuantizedLinear, nn.QuantizedEmbedding.as_linear, nn.RMSNorm and nn.RoPE through the
    extension's kernels on CPU streams (enabled=True, the default after `import mlx_h2o`), or back to
    MLX's own code (enabled=False)."""
    for (cls, method), ours in _ours.items():
        setattr(cls, method, ours if enabled else _stock_methods[(cls, method)])


def cpu_layer_kernels_enabled() -> bool:
    return all(getattr(cls, method) is ours for (cls, method), ours in _ours.items())


def _enable_by_default() -> None:
    if os.environ.get("MLX_H2O_CPU_LAYERS", "1") != "0":
        use_cpu_layer_kernels(True)
