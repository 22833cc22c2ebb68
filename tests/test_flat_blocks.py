"""llama's decoder block as one Python frame (cpu_layers.FlatLlamaBlock): it must build the ops mlx-lm's
TransformerBlock, Attention and MLP build, on the same arrays, so that every output is the same to the
bit, whatever the cache, the layers' classes and the model's options."""

import inspect

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import llama

import mlx_h2o
from mlx_h2o import cpu_layers
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
