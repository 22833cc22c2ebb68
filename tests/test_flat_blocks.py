"""llama's decoder block as one Python frame (cpu_layers.FlatLlamaBlock): it must build the ops mlx-lm's
TransformerBlock, Attention and MLP build, on the same arrays, so that every output is the same to the
bit, whatever the cache, the layers' classes and the model's options."""

import inspect

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama

import mlx_h2o
from mlx_h2o import cpu_layers
from mlx_h2o.evaluation.speed import graph_primitives
from tiny_models import tiny_model

# The calls FlatLlamaBlock.__call__ restates (whitespace aside). A new mlx-lm that changes one of
# them fails here, not silently in a model's output.
LLAMA_CALLS = {
    llama.TransformerBlock: [
        "r = self.self_attn(self.input_layernorm(x), mask, cache)",
        "h = x + r",
        "r = self.mlp(self.post_attention_layernorm(h))",
        "out = h + r",
        "return out",
    ],
    llama.Attention: [
        "B, L, D = x.shape",
        "queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)",
        "queries = queries.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)",
        "keys = keys.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)",
        "values = values.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)",
        "if cache is not None:",
        "queries = self.rope(queries, offset=cache.offset)",
        "keys = self.rope(keys, offset=cache.offset)",
        "keys, values = cache.update_and_fetch(keys, values)",
        "else:",
        "queries = self.rope(queries)",
        "keys = self.rope(keys)",
        "output = scaled_dot_product_attention(",
        "queries, keys, values, cache=cache, scale=self.scale, mask=mask",
        ")",
        "output = output.transpose(0, 2, 1, 3).reshape(B, L, -1)",
        "return self.o_proj(output)",
    ],
    llama.MLP: ["return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))"],
}


@pytest.mark.parametrize("cls", list(LLAMA_CALLS), ids=lambda c: c.__name__)
def test_llama_calls_are_what_the_flat_block_restates(cls):
    source = inspect.getsource(cls.__call__)
    body = source.split("-> mx.array:", 1)[-1] if "-> mx.array:" in source else source.split(":\n", 1)[1]
    lines = [line.strip() for line in body.splitlines() if line.strip() and not line.strip().startswith("#")]
    assert lines == LLAMA_CALLS[cls], source


def _flat(model, on: bool):
    for block in model.model.layers:
        block.__class__ = cpu_layers._flat_block(llama.TransformerBlock) if on else llama.TransformerBlock


def _outputs(model, policy, options, tokens, flat):
    """Logits of a prompt in two chunks (the second with an array mask), then token by token."""
    _flat(model, flat)
    cache = mlx_h2o.make_cache(model, policy, **options) if policy else None
    if cache is None:
        return [np.array(model(mx.array(tokens)[None]))]
    outs = [np.array(model(mx.array(tokens[:24])[None], cache=cache)),
            np.array(model(mx.array(tokens[24:40])[None], cache=cache))]
    for t in tokens[40:]:
        outs.append(np.array(model(mx.array([[t]]), cache=cache)))
    return outs


def _assert_same(model, policy, options):
    tokens = [int(t) for t in np.random.default_rng(0).integers(0, 128, 70)]
    flat, own = _outputs(model, policy, options, tokens, True), _outputs(model, policy, options, tokens, False)
    assert len(flat) == len(own)
    for a, b in zip(flat, own):
        np.testing.assert_array_equal(a, b)


# (policy, options); packed rows need a head dim that is a multiple of 32
POLICIES = [("full", {}), ("full", {"kv_dtype": "float16"}), ("rotating", {"max_kv_size": 32}),
            ("h2o", {"max_kv_size": 32}), ("h2o", {"max_kv_size": 48, "kv_bits": "4/8", "rotate": True}),
            ("h2o", {"max_kv_size": 32, "kv_dtype": "float16"}),
            ("h2o", {"max_kv_size": 48, "kv_bits": "4/8", "rotate": True, "center_keys": True, "kv_dtype": "float16"}),
            ("h2o", {"max_kv_bytes": 40000}),  # float16 rows by its rule, the budget sized before them
            (None, {})]


@pytest.mark.parametrize("policy, options", POLICIES, ids=lambda p: str(p))
def test_flat_block_gives_the_same_bits_with_the_kernel_layers(policy, options):
    model = tiny_model("llama", head_dim=32)
    nn.quantize(model, group_size=32, bits=4)
    mlx_h2o.use_cpu_layer_kernels(model)
    assert all(type(b).__bases__[0] is cpu_layers.FlatLlamaBlock for b in model.model.layers)
    _assert_same(model, policy, options)


@pytest.mark.parametrize("overrides", [{}, {"attention_bias": True, "mlp_bias": True},
                                       {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}],
                         ids=["plain", "biases", "llama3-rope"])
@pytest.mark.parametrize("kernels", [True, False], ids=["kernel-layers", "mlx-layers"])
def test_flat_block_gives_the_same_bits_with_any_layers(overrides, kernels):
    """Biased projections, a RoPE module of another class, MLX's own layers (the fork's default),
    unquantized weights: the flat block calls what it does not inline."""
    model = tiny_model("llama", **overrides)
    if kernels:
        nn.quantize(model, group_size=32, bits=4)
    mlx_h2o.use_cpu_layer_kernels(model, mlx_layers=not kernels)
    assert isinstance(model.model.layers[0], cpu_layers.FlatLlamaBlock)
    _assert_same(model, "full", {})


def test_flat_block_runs_a_replaced_attention_or_mlp_by_its_own_call():
    """A block whose attention is not llama's Attention (e.g. an adapter put in its place) runs mlx-lm's call."""
    model = tiny_model("llama")
    mlx_h2o.use_cpu_layer_kernels(model)
    block = model.model.layers[0]

    class Doubled(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def __call__(self, x, mask=None, cache=None):
            return 2 * self.inner(x, mask, cache)

    block.self_attn = Doubled(block.self_attn)
    x = mx.random.normal((1, 3, 64))
    flat = block(x)
    block.__class__ = llama.TransformerBlock
    np.testing.assert_array_equal(np.array(flat), np.array(block(x)))


def test_flat_blocks_switch_back_and_stay_in_their_model():
    model, bystander = tiny_model("llama"), tiny_model("llama")
    n = len(model.model.layers)
    changed = mlx_h2o.use_cpu_layer_kernels(model)
    assert isinstance(model.model.layers[0], cpu_layers.FlatLlamaBlock)
    assert type(bystander.model.layers[0]) is llama.TransformerBlock
    assert cpu_layers.cpu_layer_kernels_used(bystander) == 0
    assert mlx_h2o.use_cpu_layer_kernels(model, False) == changed
    assert all(type(b) is llama.TransformerBlock for b in model.model.layers)
    assert cpu_layers.cpu_layer_kernels_used(model) == 0
    assert changed >= 2 * n  # the blocks and their MLPs at least


def _packed(model):
    """Each block's packed q/k/v and each MLP's packed gate/up."""
    return [(getattr(b, "_packed_qkv", None), getattr(b.mlp, "_packed_gate_up", None)) for b in model.layers]


def _unpack(model):
    for block in model.layers:
        vars(block).pop("_packed_qkv", None)
        vars(block.mlp).pop("_packed_gate_up", None)


def _logits(model, policy, options, tokens):
    """Logits of a prompt in two chunks (40 rows: the GEMM path; 10: the integer dots), then token by token."""
    cache = mlx_h2o.make_cache(model, policy, **options)
    outs = [np.array(model(mx.array(tokens[:40])[None], cache=cache)), np.array(model(mx.array(tokens[40:50])[None], cache=cache))]
    return outs + [np.array(model(mx.array([[t]]), cache=cache)) for t in tokens[50:]]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("policy, options", [("full", {}), ("h2o", {"max_kv_size": 48, "kv_bits": "4/8", "rotate": True})],
                         ids=["full", "h2o-packed"])
@pytest.mark.parametrize("mlx_layers", [False, True], ids=["kernel-layers", "mlx-layers"])
def test_packed_projections_give_the_same_bits(arch, policy, options, mlx_layers):
    """q/k/v (llama's flat block) and gate/up (the kernel MLPs) as one product each: the same logits
    to the bit as the layers one by one, for prompts and decode, with our layers or (the fork) MLX's."""
    if mlx_layers and not cpu_layers.mlx_has_layer_kernels():
        pytest.skip("this MLX's quantized_matmul is not the kernel: MLX's layers are not packed")
    model = tiny_model(arch, hidden_size=128)  # head dim 32: packed K/V rows
    nn.quantize(model, group_size=32, bits=4)
    weights = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    mlx_h2o.use_cpu_layer_kernels(model, mlx_layers=mlx_layers)
    packed = _packed(model.model)
    assert all(gate_up is not None for _, gate_up in packed)
    assert all((qkv is not None) == (arch == "llama") for qkv, _ in packed)
    after = dict(tree_flatten(model.parameters()))
    assert after.keys() == weights.keys()  # the layers keep their own arrays (views of the packed ones)
    for k, v in after.items():
        np.testing.assert_array_equal(np.array(v), weights[k])
    tokens = [int(t) for t in np.random.default_rng(1).integers(0, 128, 64)]
    with_packing = _logits(model, policy, options, tokens)
    _unpack(model.model)
    for a, b in zip(with_packing, _logits(model, policy, options, tokens)):
        np.testing.assert_array_equal(a, b)


def test_packed_projections_give_way_to_new_weights_and_adapters():
    """model.update or a LoRA layer in place of a projection: the layers run one by one, with what
    they now hold (the packed product would be stale)."""
    from mlx_lm.tuner.lora import LoRALinear

    model = tiny_model("llama")
    nn.quantize(model, group_size=32, bits=4)
    mlx_h2o.use_cpu_layer_kernels(model)
    block = model.model.layers[0]
    other = tiny_model("llama", seed=1)
    nn.quantize(other, group_size=32, bits=4)
    block.self_attn.k_proj.update(dict(other.model.layers[0].self_attn.k_proj.parameters()))
    block.mlp.up_proj.update(dict(other.model.layers[0].mlp.up_proj.parameters()))
    block.self_attn.q_proj = LoRALinear.from_base(block.self_attn.q_proj, r=4)
    block.self_attn.q_proj.lora_b = mx.random.normal(block.self_attn.q_proj.lora_b.shape)
    assert block._packed_qkv is not None and block.mlp._packed_gate_up is not None
    x = mx.random.normal((1, 3, 64))
    packed_block = np.array(block(x, cache=mlx_h2o.make_cache(model, "full")[0]))
    assert block._packed_qkv is None and block.mlp._packed_gate_up is None  # dropped, their buffers with them
    _unpack(model.model)
    np.testing.assert_array_equal(packed_block, np.array(block(x, cache=mlx_h2o.make_cache(model, "full")[0])))


@pytest.mark.parametrize("overrides, quantize, mlx_layers", [({"attention_bias": True, "mlp_bias": True}, True, False),
                                                             ({}, False, False), ({}, True, True)],
                         ids=["biases", "unquantized", "mlx-layers"])
def test_projections_are_packed_only_where_one_product_stands_for_them(overrides, quantize, mlx_layers):
    """Biased projections, float weights, and MLX's own quantized layers where this MLX does not run
    the kernels stay one product each."""
    model = tiny_model("llama", **overrides)
    if quantize:
        nn.quantize(model, group_size=32, bits=4)
    mlx_h2o.use_cpu_layer_kernels(model, mlx_layers=mlx_layers)
    expected = mlx_layers and cpu_layers.mlx_has_layer_kernels()
    assert all((qkv is not None) == expected and (gate_up is not None) == expected for qkv, gate_up in _packed(model.model))
    mlx_h2o.use_cpu_layer_kernels(model, False)
    assert all("_packed_qkv" not in vars(b) and "_packed_gate_up" not in vars(b.mlp) for b in model.model.layers)


@pytest.mark.parametrize("kv_dtype", [None, "float16"])
@pytest.mark.parametrize("mlx_layers", [False, True], ids=["kernel-layers", "mlx-layers"])
def test_a_decode_step_is_four_products_and_five_other_primitives_a_layer(kv_dtype, mlx_layers):
    """Each primitive costs ~8 µs of a 2-core decode step (docs/cpu-decode.md). With q/k/v packed, a
    layer's step is: the q/k/v product with the input norm inside it; one kernel making q, k, v of it,
    q and k rotated; the cache's two writes; attention; a reshape; o_proj's product with the residual
    add inside it; the gate/up product with the post-attention norm inside it; down_proj's product
    with the swiglu of that and the residual add inside it. The full cache's rows reach the fused
    kernel as its buffers, not as slices of them (the fork's MLX SDPA, for rows in the queries'
    dtype, takes them sliced)."""
    if mlx_layers and not cpu_layers.mlx_has_layer_kernels():
        pytest.skip("this MLX's quantized_matmul is not the kernel: MLX's layers are not packed")
    model = tiny_model("llama", hidden_size=128)
    nn.quantize(model, group_size=32, bits=4)
    mlx_h2o.use_cpu_layer_kernels(model, mlx_layers=mlx_layers)
    assert all(qkv is not None for qkv, _ in _packed(model.model))
    cache = mlx_h2o.make_cache(model, "full", **({"kv_dtype": kv_dtype} if kv_dtype else {}))
    mx.eval(model(mx.array([list(range(1, 11))]), cache=cache))
    out = model(mx.array([[3]]), cache=cache)
    counts = graph_primitives(out)
    mx.eval(out)
    layers = len(model.layers)

    def named(part):
        return sum(n for name, n in counts.items() if part in name)

    assert counts["SplitHeadsRoPE"] == layers and named("RoPE") == layers
    assert "Split" not in counts
    assert named("QuantizedMatmul") == 4 * layers + 1  # + the tied lm_head
    assert named("RMSNorm") == 1  # the model's final norm: the blocks' norms are inside their products
    assert counts["SliceUpdate"] == 2 * layers and "SwiGLUCPU" not in counts
    sliced = mlx_h2o.hook._MLX_SDPA_IS_FUSED and kv_dtype is None
    assert counts.get("Slice", 0) == (2 * layers if sliced else 0)
    assert "AsType" not in counts  # float16 rows come out of SplitHeadsRoPE as the cache keeps them
