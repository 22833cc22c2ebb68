"""CPU kernels for the layers of every mlx-lm model, switched in with no model edits:

- `quantized_matmul` for `nn.QuantizedLinear` and `nn.QuantizedEmbedding.as_linear` (the tied lm_head),
  and `quantized_embedding` for `nn.QuantizedEmbedding`'s lookup;
- the same for the tensor-parallel quantized layers mlx-lm's `model.shard` puts in their place;
- `rms_norm` for `nn.RMSNorm` and `rope` for `nn.RoPE` (integer offsets): on the CPU MLX runs its fast
  ops as composed fallbacks, 11 and 29 primitives a call, two of each per layer: most of a decode
  step's primitives, each paying dispatch. Here each is one primitive.
- `swiglu` for the SwiGLU MLPs of llama, qwen2, qwen3 and olmo2 (`SWIGLU_MLPS`): mlx-lm's `swiglu` is an
  `mx.compile`d function, on Linux a JIT-compiled loop of scalar `exp` calls.
- llama's decoder block (`LLAMA_BLOCKS`) as one Python frame, the layers above called inline: the same
  ops, built with less Python.
- q/k/v (the flat block) and gate/up (the SwiGLU MLPs) as one packed product each
  (`PackedProjections`): fewer products a step, the same bits. In the flat block the ops around the
  products go into them (the norms before, the residual adds after) and one kernel makes the packed
  q/k/v product into rotated q and k and v (`split_heads_rope`): ten primitives a layer's decode step
  (mlx-lm's call on MLX's CPU ops builds ~130).

Decode is a matrix-vector product per layer: MLX's CPU `quantized_matmul` unpacks every weight to a
float first, and dequantized float32 weights move 4x the bytes. The kernel (csrc/kernels/
quantized_matmul_cpu_impl.h) quantizes each row of x once to int8 per 32 values and dots it with the
packed 4-bit / 8-bit weights in integer arithmetic (AVX2 maddubs/madd where the CPU has it), threads
over output columns. Up to 32 rows of x (decode, batches, short prompt chunks) take the kernel; longer
inputs (prefill) dequantize and multiply with a BLAS GEMM, which is cheaper from ~48 rows on.

Switched in per model, never globally: `use_cpu_layer_kernels(model)` changes the class of that
model's stock layers to a subclass whose call runs the kernel (as `nn.quantize` swaps modules; weights
are shared, nothing is copied), and `mlx_h2o.load()` does so for the models it returns. Other models in
the process keep MLX's own layers. Each call takes the kernel on CPU streams only (and for quantized
layers: affine mode, bits 4/8, groups 32/64/128); anything else falls back to MLX's own method.
"""

import sys
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import QuantizedAllToShardedLinear, QuantizedShardedToAllLinear, sum_gradients
from mlx.utils import tree_flatten

from ._allocator import give_back_free_heap
from ._native import _ext

KERNEL_BITS = (4, 8)
KERNEL_GROUP_SIZES = (32, 64, 128)
LOOKUP_BITS = (2, 3, 4, 5, 6, 8)  # the embedding lookup's (its dequantize's) formats
# Rows of x up to which the layers take the integer-dot kernel (decode, batches); longer inputs
# dequantize + GEMM. The C++ default (QMM_MAX_ROWS, where the measurement is); a module setting so
# that a test can push whole prompts through the kernel.
KERNEL_MAX_ROWS = 32


def quantized_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    *,
    group_size: int,
    bits: int,
    max_rows: Optional[int] = None,
    norm_weight: Optional[mx.array] = None,
    norm_eps: Optional[float] = None,
    residual: Optional[mx.array] = None,
    swiglu: bool = False,
    swiglu_output: bool = False,
    stream=None,
) -> mx.array:
    """x @ W^T for W = (w, scales, biases) as `mx.quantize(W, group_size, bits)` returns it, like
    `mx.quantized_matmul(..., transpose=True)`. x: (..., K) float32/float16/bfloat16; bits 4 or 8;
    group_size 32, 64 or 128. CPU streams run the integer-dot kernel when x has at most `max_rows`
    rows (default 32), else dequantize + matmul (also what other streams run): for float32, one
    primitive that dequantizes W a block of rows at a time into the GEMM, so the whole W is never
    dense at once. The kernel rounds x to int8 per 32 values: relative error ~ 1 / 254 of each
    block's largest |x| per term.

    The ops around a decoder layer's products, in the same primitive and with the same bits as the
    ops one by one: with `norm_eps`, the product of `mx.fast.rms_norm(x, norm_weight, norm_eps)`;
    with `swiglu`, x (..., 2K) is a packed gate/up product and the product is of `swiglu(gate, up)`;
    with `residual` (the product's shape), `residual + x @ W^T`; with `swiglu_output`, W's rows are
    gate then up and the result is the activation `swiglu(gate, up)` of the product's halves
    (..., N / 2), which the GEMM writes a block at a time (shorter x: the product, then the activation)."""
    for name, v in (("group_size", group_size), ("bits", bits)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{name} must be an integer, got {v!r}")
    if max_rows is not None and (isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 0):
        raise ValueError(f"max_rows must be None or an integer >= 0, got {max_rows!r}")
    return _ext.quantized_matmul(x, w, scales, biases, group_size, bits, -1 if max_rows is None else max_rows,
                                 norm_weight, None if norm_eps is None else float(norm_eps), residual, bool(swiglu),
                                 bool(swiglu_output), stream=stream)


def _kernel_format(layer, bits=KERNEL_BITS) -> bool:
    """Whether a quantized layer's weights are in the integer-dot kernel's formats (or, with
    bits=LOOKUP_BITS, the embedding lookup's)."""
    return (
        getattr(layer, "mode", "affine") == "affine"
        and layer.bits in bits
        and layer.group_size in KERNEL_GROUP_SIZES
        and layer.get("biases") is not None
    )


def _kernel_handles(layer) -> bool:
    return _kernel_format(layer) and _on_cpu()


def rms_norm(x: mx.array, weight: Optional[mx.array], eps: float, *, stream=None) -> mx.array:
    """`mx.fast.rms_norm(x, weight, eps)`, one kernel on CPU streams (float32 math, rounded once)."""
    return _ext.rms_norm(x, weight, float(eps), stream)


def rope(x: mx.array, dims: int, *, traditional: bool, base: float, scale: float, offset: int, stream=None) -> mx.array:
    """`mx.fast.rope(x, dims, ...)` for an integer offset, one kernel on CPU streams (angles in float64)."""
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise ValueError(f"offset must be an integer (use mx.fast.rope for array offsets), got {offset!r}")
    return _ext.rope(x, int(dims), bool(traditional), float(base), float(scale), offset, stream)


def split_heads_rope(x: mx.array, heads, head_dim: int, *, rotated: int, dims: int, traditional: bool = False,
                     base: float = 10000.0, scale: float = 1.0, offset: int = 0, dtypes=None, stream=None) -> list:
    """A packed projection of groups of heads as the attention's arrays: x (B, L, sum(heads) * head_dim)
    holds the groups side by side (a packed q/k/v product, heads = [n_heads, n_kv_heads, n_kv_heads]);
    returns one (B, heads[i], L, head_dim) array per group, the first `rotated` through
    `mx.fast.rope(..., dims, traditional=, base=, scale=, offset=)`, and each group in its dtype of
    `dtypes` (None: x's; the values of `.astype(dtype)` of the group). One kernel on CPU streams (the
    reshape, transpose, splits, RoPE calls and casts elsewhere), with the same bits as those ops."""
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise ValueError(f"offset must be an integer, got {offset!r}")
    if dtypes is not None and (not isinstance(dtypes, (list, tuple)) or not all(isinstance(d, mx.Dtype) for d in dtypes)):
        raise ValueError(f"dtypes must be None or a list of mx dtypes, one per group, got {dtypes!r}")
    return _ext.split_heads_rope(x, [int(h) for h in heads], int(head_dim), int(rotated), int(dims), bool(traditional),
                                 float(base), float(scale), offset, list(dtypes or ()), stream)


def swiglu(gate: mx.array, up: mx.array, *, stream=None) -> mx.array:
    """`gate * mx.sigmoid(gate) * up` (mlx-lm's `swiglu`), one kernel on CPU streams (float32 math,
    rounded once). gate and up have one shape and one float dtype."""
    return _ext.swiglu(gate, up, stream)


# The fork's MLX (patches/mlx, `scripts/series.py build mlx`) runs these layers with the same kernels
# from this release of its series on.
FORK_LAYER_KERNELS_SINCE = 5


def mlx_has_layer_kernels() -> bool:
    """Whether this MLX runs the integer-dot quantized matmul, rms_norm and rope kernels itself."""
    label = mx.__version__.partition("+")[2]
    name, _, rev = label.partition(".")
    return name == "h2o" and rev.isdigit() and int(rev) >= FORK_LAYER_KERNELS_SINCE


def _on_cpu() -> bool:
    return mx.default_device() == mx.cpu


_MLX_RUNS_LAYER_KERNELS = mlx_has_layer_kernels()


def _runs_kernel(layer, ours, mlx_class) -> bool:
    """Whether `layer`'s CPU call is the kernel: our class, or MLX's where this MLX runs the kernels."""
    return type(layer) is ours or (type(layer) is mlx_class and _MLX_RUNS_LAYER_KERNELS)


def _kernel_product(layer) -> bool:
    """Whether a direct call of the integer-dot kernel on `layer`'s arrays gives its output (a packed
    product, a product with fused ops): a quantized linear layer whose call is the kernel, in its
    formats, without a bias."""
    return _runs_kernel(layer, KernelQuantizedLinear, nn.QuantizedLinear) and _kernel_format(layer) and "bias" not in layer


# The kernel classes' calls on a CPU stream, one function each: the classes below call them, and so do
# the flat llama blocks, which skip the classes' own call (FlatLlamaBlock).


def _rms_norm_on_cpu(layer, x):
    return _ext.rms_norm(x, layer["weight"], layer.eps, None)


def _rope_on_cpu(layer, x, offset):
    if not isinstance(offset, int) or x.ndim not in (3, 4):
        return nn.RoPE.__call__(layer, x, offset)
    return _ext.rope(x, layer.dims, layer.traditional, layer.base, layer.scale, offset, None)


def _packed_matmul(layer, x):
    """x @ W^T of a quantized layer's packed weights through the integer-dot kernel."""
    return _ext.quantized_matmul(x, layer["weight"], layer["scales"], layer["biases"], layer.group_size, layer.bits, KERNEL_MAX_ROWS)


def _quantized_linear_on_cpu(layer, x):
    if not _kernel_format(layer):
        return nn.QuantizedLinear.__call__(layer, x)
    y = _packed_matmul(layer, x)
    return y + layer["bias"] if "bias" in layer else y


class KernelRMSNorm(nn.RMSNorm):
    """nn.RMSNorm whose CPU call is one kernel (MLX's CPU fallback composes 11 primitives)."""

    def __call__(self, x):
        return _rms_norm_on_cpu(self, x) if _on_cpu() else super().__call__(x)


class KernelRoPE(nn.RoPE):
    """nn.RoPE whose CPU call with an integer offset is one kernel (MLX's fallback: 29 primitives)."""

    def __call__(self, x, offset: int = 0):
        return _rope_on_cpu(self, x, offset) if _on_cpu() else super().__call__(x, offset)


class KernelQuantizedLinear(nn.QuantizedLinear):
    """nn.QuantizedLinear whose CPU call of up to KERNEL_MAX_ROWS rows runs the integer-dot kernel."""

    def __call__(self, x):
        return _quantized_linear_on_cpu(self, x) if _on_cpu() else super().__call__(x)


class QuantizedEmbeddingLookup(nn.QuantizedEmbedding):
    """nn.QuantizedEmbedding whose lookup is one kernel on CPU: MLX gathers the packed rows and
    dequantizes them with ~36 primitives, each paying a decode step's dispatch. MLX has no op for it,
    so this class also comes with MLX's own layers (use_cpu_layer_kernels(mlx_layers=True))."""

    def __call__(self, x):
        if not (_on_cpu() and _kernel_format(self, LOOKUP_BITS) and x.dtype in (mx.int32, mx.uint32)):
            return super().__call__(x)
        return _ext.quantized_embedding(x, self["weight"], self["scales"], self["biases"], self.group_size, self.bits, None)


class KernelQuantizedEmbedding(QuantizedEmbeddingLookup):
    """The lookup's kernel, and `as_linear` (a tied lm_head) by the integer-dot kernel on CPU."""

    def as_linear(self, x):
        if not _kernel_handles(self):
            return super().as_linear(x)
        return _packed_matmul(self, x)


class KernelQuantizedAllToShardedLinear(QuantizedAllToShardedLinear):
    """Tensor parallel (mlx-lm's `model.shard`): this rank's slice of the output columns, by the
    integer-dot kernel, so that sharded and single-rank models run the same arithmetic."""

    def __call__(self, x):
        if not _kernel_handles(self):
            return super().__call__(x)
        y = _packed_matmul(self, sum_gradients(self.group)(x))
        return y + self["bias"] if "bias" in self else y


class KernelQuantizedShardedToAllLinear(QuantizedShardedToAllLinear):
    """Tensor parallel: this rank's slice of the input columns by the integer-dot kernel, summed over
    the group. The slices start at multiples of the group size, so x's int8 blocks are one rank's."""

    def __call__(self, x):
        if not _kernel_handles(self):
            return super().__call__(x)
        y = mx.distributed.all_sum(_packed_matmul(self, x), group=self.group)
        return y + self["bias"] if "bias" in self else y


# mlx-lm MLP classes whose call is exactly `down_proj(swiglu(gate_proj(x), up_proj(x)))`, by module and
# name (tests/test_exp_ops.py checks each class's source still says so).
SWIGLU_MLPS = {("mlx_lm.models.llama", "MLP"), ("mlx_lm.models.qwen2", "MLP"), ("mlx_lm.models.qwen3", "MLP"),
               ("mlx_lm.models.olmo2", "MLP")}


class PackedProjections:
    """Quantized projections of one input (q/k/v, gate/up) as one packed matmul: their weights, scales
    and biases concatenated by output rows, once, when the kernels are switched in. The layers keep
    their own arrays as views of the packed ones, so no weight is held twice.

    Why: at decode each product is one primitive with its own dispatch, thread-pool round and int8
    rounding of x; q/k/v are three of them on the same x, and k/v (192 columns on the embedded model)
    are too small to thread. One product over the rows of all of them gives each output column the
    same integer dots, so the same bits (tests/test_flat_blocks.py). Used only while every layer still
    holds the arrays it was packed from: an adapter or `model.update` in their place makes the caller
    run the layers one by one and drop the packed arrays.

    Parameters
    ----------
    layers:
        the projections, in output order: of one class (KernelQuantizedLinear, or MLX's
        nn.QuantizedLinear where this MLX runs the kernels), one format the kernel takes, no bias.
    """

    def __init__(self, layers):
        first = layers[0]
        self.group_size, self.bits = first.group_size, first.bits
        self.our_layers = type(first) is KernelQuantizedLinear  # else MLX's, whose quantized_matmul is the kernel
        names = ("weight", "scales", "biases")
        packed = [mx.concatenate([layer[name] for layer in layers]) for name in names]
        mx.eval(packed)
        self.weight, self.scales, self.biases = packed
        self.rows = rows = [layer["weight"].shape[0] for layer in layers]  # each layer's output columns
        starts = [sum(rows[:i]) for i in range(len(rows))]
        self.bounds = starts[1:]
        self.parts = [tuple(array[start : start + n] for array in packed) for start, n in zip(starts, rows)]
        mx.eval(self.parts)
        for layer, part in zip(layers, self.parts):
            layer.update(dict(zip(names, part)))  # the layer's arrays become views of the packed buffers: the originals go

    @classmethod
    def of(cls, layers) -> Optional["PackedProjections"]:
        """The packed projections of `layers`, or None where one product cannot stand for them."""
        if len({type(layer) for layer in layers}) != 1 or not all(_kernel_product(layer) for layer in layers):
            return None
        first = layers[0]
        if any((layer.group_size, layer.bits, layer["weight"].shape[1:]) != (first.group_size, first.bits, first["weight"].shape[1:])
               for layer in layers):
            return None
        return cls(layers)

    def current(self, *layers) -> bool:
        """Whether `layers` still hold the arrays packed here (nothing put an adapter or new weights in)."""
        for layer, (w, s, b) in zip(layers, self.parts):
            if layer.get("weight") is not w or layer.get("scales") is not s or layer.get("biases") is not b:
                return False
        return True

    def product(self, x, norm=None, swiglu_output=False):
        """The packed product: every layer's output, in layer order along the last axis. Of norm(x) for
        an RMSNorm layer `norm` (a block's norm before its projections), which the kernel applies to x
        itself where the norm's call is the kernel: one primitive where there were two, the same bits.
        swiglu_output: the activation of a gate/up product instead (swiglu of its halves), which a
        long x's GEMM writes a block at a time, never holding the whole product."""
        if norm is not None:
            if _runs_kernel(norm, KernelRMSNorm, nn.RMSNorm):
                return _ext.quantized_matmul(x, self.weight, self.scales, self.biases, self.group_size, self.bits,
                                             KERNEL_MAX_ROWS, norm["weight"], norm.eps, None, False, swiglu_output)
            x = _norm(norm, x)
        if self.our_layers or swiglu_output:
            return _ext.quantized_matmul(x, self.weight, self.scales, self.biases, self.group_size, self.bits, KERNEL_MAX_ROWS,
                                         None, None, None, False, swiglu_output)
        return mx.quantized_matmul(x, self.weight, self.scales, self.biases, transpose=True, group_size=self.group_size, bits=self.bits)

    def __call__(self, x):
        return mx.split(self.product(x), self.bounds, axis=-1)


def _prefill(x) -> bool:
    """Whether x has more rows than the integer-dot kernel takes: its products are the blocked GEMM."""
    return x.size > KERNEL_MAX_ROWS * x.shape[-1]


def _packed(owner, name: str, *layers) -> Optional[PackedProjections]:
    """owner's PackedProjections `name`: while `layers` still hold its arrays (a stale one is dropped,
    and its buffers with it)."""
    packed = getattr(owner, name)
    if packed is None:
        return None
    if not packed.current(*layers):
        setattr(owner, name, None)
        return None
    return packed


class KernelSwiGLU:
    """Put before a SWIGLU_MLPS class: its gated activation is the `swiglu` kernel on CPU streams, and
    gate/up one packed product (PackedProjections) where their layers allow."""

    _packed_gate_up = None  # set by use_cpu_layer_kernels

    def __call__(self, x):
        return _swiglu_mlp(self, x) if _on_cpu() else super().__call__(x)


_kernel_mlps = {}


def _kernel_mlp(cls):
    """The KernelSwiGLU subclass of a SWIGLU_MLPS class, made once."""
    if cls not in _kernel_mlps:
        _kernel_mlps[cls] = type(f"Kernel{cls.__name__}", (KernelSwiGLU, cls), {"__module__": __name__})
    return _kernel_mlps[cls]


# mlx-lm decoder blocks whose call, with its Attention's and MLP's, is exactly llama's (tests/
# test_flat_blocks.py checks each class's source still says so).
LLAMA_BLOCKS = {("mlx_lm.models.llama", "TransformerBlock")}


# layer(x) for a layer of the flat block, whose caller has checked for a CPU stream: a kernel class's
# call without its own check, any other class's call as it is.


def _linear(layer, x):
    return _quantized_linear_on_cpu(layer, x) if type(layer) is KernelQuantizedLinear else layer(x)


def _norm(layer, x):
    return _rms_norm_on_cpu(layer, x) if type(layer) is KernelRMSNorm else layer(x)


def _rope(layer, x, offset):
    return _rope_on_cpu(layer, x, offset) if type(layer) is KernelRoPE else layer(x, offset=offset)


def _product(layer, x, residual=None, *, swiglu=False):
    """layer(x), or with swiglu layer(swiglu of x's halves: a packed gate/up product), plus residual
    (None: nothing). Where the layer's call is the integer-dot kernel the swiglu and the add are done
    in the product's primitive, with the same bits: one primitive where there were up to three (for long
    x, a prefill's, the product's blocked GEMM applies them as well)."""
    if (swiglu or residual is not None) and _kernel_product(layer):
        return _ext.quantized_matmul(x, layer["weight"], layer["scales"], layer["biases"], layer.group_size, layer.bits,
                                     KERNEL_MAX_ROWS, None, None, residual, swiglu)
    y = _linear(layer, _ext.swiglu_halves(x, None) if swiglu else x)
    return y if residual is None else residual + y


def _swiglu_mlp(mlp, x, norm=None, residual=None):
    """A KernelSwiGLU MLP's call on a CPU stream: of norm(x) for an RMSNorm layer `norm` (the block's
    norm before it), plus `residual`; each fused into a product where the layers allow."""
    gate_proj, up_proj = mlp["gate_proj"], mlp["up_proj"]
    packed = _packed(mlp, "_packed_gate_up", gate_proj, up_proj)
    if packed and packed.rows[0] == packed.rows[1]:  # the kernels read gate and up in place: no split in the graph
        if _prefill(x):  # the GEMM writes the activation, never the whole gate/up product (a prefill's peak memory)
            return _product(mlp["down_proj"], packed.product(x, norm, swiglu_output=True), residual)
        return _product(mlp["down_proj"], packed.product(x, norm), residual, swiglu=True)
    if norm is not None:
        x = _norm(norm, x)
    gate, up = packed(x) if packed else (_linear(gate_proj, x), _linear(up_proj, x))
    if gate.dtype != up.dtype or gate.shape != up.shape:  # the kernel's domain; mlx-lm's own otherwise
        from mlx_lm.models.activations import swiglu as mlx_lm_swiglu

        return _product(mlp["down_proj"], mlx_lm_swiglu(gate, up), residual)
    return _product(mlp["down_proj"], _ext.swiglu(gate, up, None), residual)


class FlatLlamaBlock:
    """Put before a LLAMA_BLOCKS class: on CPU streams its call, its attention's and its MLP's run as one
    Python frame, with the kernel layers' calls inlined. The same ops on the same arrays, so the same
    bits; a decode step's graph is built ~0.5 ms sooner (of ~2.4 ms), time that mlx-lm's
    generate_step, building step t + 1 while step t evaluates, takes from the kernels' threads on a
    2-core machine (docs/cpu-decode.md). Any other attention or MLP class runs its own call."""

    _model_module = None  # the block's mlx-lm module (its Attention, MLP and attention function), set by _flat_block
    _packed_qkv = None  # PackedProjections of q/k/v, set by use_cpu_layer_kernels

    def __call__(self, x, mask=None, cache=None):
        llama = self._model_module
        attn, mlp = self["self_attn"], self["mlp"]
        if type(attn) is not llama.Attention or not isinstance(mlp, llama.MLP) or not _on_cpu():
            return super().__call__(x, mask, cache)
        B, L, _ = x.shape
        norm, rope = self["input_layernorm"], attn["rope"]
        packed = _packed(self, "_packed_qkv", attn["q_proj"], attn["k_proj"], attn["v_proj"])
        heads = [attn.n_heads, attn.n_kv_heads, attn.n_kv_heads]
        d = packed.rows[0] // attn.n_heads if packed else 0  # the head dimension
        offset = cache.offset if cache is not None else 0
        if (packed and packed.rows == [n * d for n in heads] and isinstance(offset, int)
                and _runs_kernel(rope, KernelRoPE, nn.RoPE)):
            # q/k/v packed: the norm is applied inside the product, and one kernel makes the product's
            # (B, L, heads * D) into q, k and v as (B, heads, L, D), q and k rotated (the same
            # angles and bits as RoPE calls on each): 2 primitives where there were 7 (a norm, a
            # product, a reshape, two splits, a RoPE; before packing, 10). Each costs ~8 µs of a
            # 2-core decode step (docs/cpu-decode.md).
            qkv = packed.product(x, norm)
            # A cache that keeps its rows in another dtype (float16 rows of a float32 model) gets keys
            # and values in it from the kernel: the cast of each would be two more primitives.
            kept = cache.kept_dtype(qkv.dtype) if hasattr(cache, "kept_dtype") else qkv.dtype
            dtypes = [qkv.dtype, kept, kept] if kept != qkv.dtype else []
            queries, keys, values = _ext.split_heads_rope(qkv, heads, d, 2, rope.dims, rope.traditional, rope.base,
                                                          rope.scale, offset, dtypes, None)
            if cache is not None:
                keys, values = cache.update_and_fetch(keys, values)
        else:
            queries, keys, values = self._projected(attn, packed, _norm(norm, x), rope, cache)
        out = llama.scaled_dot_product_attention(queries, keys, values, cache=cache, scale=attn.scale, mask=mask)
        out = out.reshape(B, 1, -1) if L == 1 else out.transpose(0, 2, 1, 3).reshape(B, L, -1)
        h = _product(attn["o_proj"], out, x)  # the residual add inside o_proj's product
        post_norm = self["post_attention_layernorm"]
        if isinstance(mlp, KernelSwiGLU):
            return _swiglu_mlp(mlp, h, post_norm, h)
        return h + mlp(_norm(post_norm, h))

    @staticmethod
    def _projected(attn, packed, h, rope, cache):
        """Queries, keys and values of the attention's input h: rotated, and the keys and values through
        the cache."""
        q_proj, k_proj, v_proj = attn["q_proj"], attn["k_proj"], attn["v_proj"]
        B, L, _ = h.shape
        queries, keys, values = packed(h) if packed else (_linear(q_proj, h), _linear(k_proj, h), _linear(v_proj, h))
        if L == 1:  # a decode step: (B, 1, heads, D) transposed holds (B, heads, 1, D) in the same order, one op fewer
            queries = queries.reshape(B, attn.n_heads, 1, -1)
            keys, values = keys.reshape(B, attn.n_kv_heads, 1, -1), values.reshape(B, attn.n_kv_heads, 1, -1)
        else:
            queries = queries.reshape(B, L, attn.n_heads, -1).transpose(0, 2, 1, 3)
            keys = keys.reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
            values = values.reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if cache is None:
            return rope(queries), rope(keys), values
        offset = cache.offset
        queries, keys = _rope(rope, queries, offset), _rope(rope, keys, offset)
        keys, values = cache.update_and_fetch(keys, values)
        return queries, keys, values


_flat_blocks = {}


def _flat_block(cls):
    """The FlatLlamaBlock subclass of a LLAMA_BLOCKS class, made once."""
    if cls not in _flat_blocks:
        namespace = {"__module__": __name__, "_model_module": sys.modules[cls.__module__]}
        _flat_blocks[cls] = type(f"Flat{cls.__name__}", (FlatLlamaBlock, cls), namespace)
    return _flat_blocks[cls]


# stock class -> ours. Only exact instances are switched: a subclass may override the call.
KERNEL_CLASSES = {
    nn.RMSNorm: KernelRMSNorm,
    nn.RoPE: KernelRoPE,
    nn.QuantizedLinear: KernelQuantizedLinear,
    nn.QuantizedEmbedding: KernelQuantizedEmbedding,
    QuantizedAllToShardedLinear: KernelQuantizedAllToShardedLinear,
    QuantizedShardedToAllLinear: KernelQuantizedShardedToAllLinear,
}
# With MLX's own layers (mlx_layers=True): the ops MLX has none for.
_MLX_LAYERS_CLASSES = {nn.QuantizedEmbedding: QuantizedEmbeddingLookup}
_STOCK_CLASSES = {ours: stock for table in (KERNEL_CLASSES, _MLX_LAYERS_CLASSES) for stock, ours in table.items()}


def use_cpu_layer_kernels(model: nn.Module, enabled: bool = True, *, mlx_layers: bool = False) -> int:
    """Switch `model`'s nn.RMSNorm, nn.RoPE, nn.QuantizedLinear, nn.QuantizedEmbedding, SWIGLU_MLPS and
    LLAMA_BLOCKS modules to the kernel subclasses above (enabled=True) or back to their own classes
    (enabled=False), in place; returns how many modules changed. Only this model is affected, except
    that packing its projections (PackedProjections) empties MLX's buffer cache.
    mlx_layers: keep MLX's norm, RoPE and quantized layers (the fork's MLX runs them on the kernels);
    a quantized embedding's lookup still takes its kernel (QuantizedEmbeddingLookup)."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"use_cpu_layer_kernels needs an mlx.nn.Module, got {type(model).__name__}")
    table = _MLX_LAYERS_CLASSES if enabled and mlx_layers else KERNEL_CLASSES if enabled else _STOCK_CLASSES
    changed = 0
    for _, module in model.named_modules():
        cls = type(module)
        new = table.get(cls)
        name = (cls.__module__, cls.__qualname__)
        if enabled and name in SWIGLU_MLPS:
            new = _kernel_mlp(cls)
        elif enabled and name in LLAMA_BLOCKS:
            new = _flat_block(cls)
        elif not enabled and cls.__bases__[0] in (KernelSwiGLU, FlatLlamaBlock):
            new = cls.__bases__[1]
        if new is not None:
            module.__class__ = new
            changed += 1
    for _, module in list(model.named_modules()):  # once every layer has its class
        if _pack_projections(module, enabled):
            # The module's former arrays are free now; MLX would keep their buffers for arrays of the
            # same sizes, which decode never makes again. Emptied module by module, not once at the
            # end: the whole model's would lift the peak RSS by ~21 MiB (+20-36 MiB in bench_peer kept).
            mx.clear_cache()
    return changed


def _pack_projections(module, enabled: bool) -> bool:
    """A flat block's q/k/v and a kernel MLP's gate/up as PackedProjections (enabled), or not.
    Returns whether it packed any."""
    if not enabled:
        vars(module).pop("_packed_qkv", None)
        vars(module).pop("_packed_gate_up", None)
    elif isinstance(module, FlatLlamaBlock):
        projections = [module["self_attn"].get(name) for name in ("q_proj", "k_proj", "v_proj")]
        module._packed_qkv = PackedProjections.of(projections) if all(isinstance(p, nn.Module) for p in projections) else None
        return module._packed_qkv is not None
    elif isinstance(module, KernelSwiGLU):
        module._packed_gate_up = PackedProjections.of([module["gate_proj"], module["up_proj"]])
        return module._packed_gate_up is not None
    return False


def use_default_cpu_kernels(model: nn.Module) -> int:
    """What `mlx_h2o.load()` and `run_mlx_lm` do to a model: on the CPU, every kernel on stock MLX; on the
    fork's MLX, which runs the norm, RoPE, quantized-layer and attention kernels itself, the SwiGLU MLPs
    (MLX has no op for them) and the flat llama blocks only; then its weights onto huge pages
    (`weights_on_huge_pages`). Off the CPU, nothing. Returns how many modules changed."""
    if not _on_cpu():
        return 0
    changed = use_cpu_layer_kernels(model, mlx_layers=mlx_has_layer_kernels())
    # The packing above frees what it copied. Returned first, those heap pages are not folded into
    # the weights' huge pages (4 MiB of the embedded model's RSS after the load, huge pages kept).
    give_back_free_heap()
    weights_on_huge_pages(model)
    return changed


def weights_on_huge_pages(model: nn.Module) -> int:
    """Move `model`'s parameters onto 2 MiB pages where the OS can (Linux 6.1+ with transparent huge
    pages; elsewhere nothing): the same arrays, contents and addresses. Returns the bytes moved.

    Why: a decode step reads every weight once, ~100 MB on the embedded model, and on 4 KiB pages each
    4 KiB of that stream misses the TLB; the products read at a sixth of what a plain read of the cores
    gets. Measured through `generate_step` at 512 tokens: a step 2-6 % shorter (docs/cpu-decode.md,
    "Clean upper registers after every kernel, and the weights on huge pages"). Only this model's
    memory: the 2 MiB blocks its arrays fill at least half of (`_ext.collapse_into_huge_pages`), with
    no change to the C allocator or to other arrays."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"weights_on_huge_pages needs an mlx.nn.Module, got {type(model).__name__}")
    return _ext.collapse_into_huge_pages([array for _, array in tree_flatten(model.parameters())])


def cpu_layer_kernels_used(model: nn.Module) -> int:
    """How many of `model`'s modules run the kernels."""
    return sum(type(m) in _STOCK_CLASSES or isinstance(m, (KernelSwiGLU, FlatLlamaBlock)) for _, m in model.named_modules())
