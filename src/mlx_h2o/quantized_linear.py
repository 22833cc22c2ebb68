"""`quantized_matmul`: x @ W^T over MLX's packed affine weights with integer dot products on the CPU,
and the switch that makes every `nn.QuantizedLinear` / `nn.QuantizedEmbedding.as_linear` (mlx-lm's
quantized models, the tied lm_head included) use it, with no model edits.

Decode is a matrix-vector product per layer: MLX's CPU `quantized_matmul` unpacks every weight to a
float first, and dequantized float32 weights move 4x the bytes. The kernel (csrc/kernels/
quantized_matmul_cpu_impl.h) quantizes each row of x once to int8 per 32 values and dots it with the
packed 4-bit / 8-bit weights in integer arithmetic (AVX2 maddubs/madd where the CPU has it), threads
over output columns. Up to 8 rows of x (decode, small batches) take the kernel; longer inputs
(prefill) dequantize and multiply with a BLAS GEMM.

On by default once `mlx_h2o` is imported (CPU streams, affine mode, bits 4/8, groups 32/64/128;
anything else keeps MLX's own path). Opt out with `use_fast_quantized_matmul(False)` or the
environment variable MLX_H2O_QUANTIZED_MATMUL=0.
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
        and mx.default_device() == mx.cpu
    )


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


_stock = {
    "QuantizedLinear.__call__": nn.QuantizedLinear.__call__,
    "QuantizedEmbedding.as_linear": nn.QuantizedEmbedding.as_linear,
}
_ours = {"QuantizedLinear.__call__": _linear_call, "QuantizedEmbedding.as_linear": _embedding_as_linear}
_classes = {"QuantizedLinear": nn.QuantizedLinear, "QuantizedEmbedding": nn.QuantizedEmbedding}


def use_fast_quantized_matmul(enabled: bool = True) -> None:
    """Route nn.QuantizedLinear and nn.QuantizedEmbedding.as_linear through the integer-dot kernel on
    CPU streams (enabled=True, the default after `import mlx_h2o`), or back to MLX's own code."""
    for key in _stock:
        cls, method = key.split(".")
        setattr(_classes[cls], method, (_ours if enabled else _stock)[key])


def fast_quantized_matmul_enabled() -> bool:
    return nn.QuantizedLinear.__call__ is _linear_call


def _enable_by_default() -> None:
    if os.environ.get("MLX_H2O_QUANTIZED_MATMUL", "1") != "0":
        use_fast_quantized_matmul(True)
