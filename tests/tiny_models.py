"""Tiny random-weight mlx-lm models of many architectures (a few layers, 64-wide): fast enough to
generate hundreds of tokens in a test, real enough to exercise each architecture's attention path."""

import mlx.core as mx
from mlx_lm.utils import _get_classes

_BASE = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=128)

CONFIGS = {
    "llama": dict(_BASE, model_type="llama"),
    "qwen2": dict(_BASE, model_type="qwen2"),
    "qwen3": dict(_BASE, model_type="qwen3", head_dim=16, max_position_embeddings=4096, tie_word_embeddings=True,
                  rope_theta=10000.0),
    "mistral": dict(_BASE, model_type="mistral"),
    # mlx-lm's gemma2 computes soft-capped attention inline (it never reaches the hook).
    "gemma2": dict(_BASE, model_type="gemma2", head_dim=16, query_pre_attn_scalar=16.0),
    # Layers 1 and 3 global (h2o), layers 0 and 2 sliding (their own RotatingKVCache).
    "gemma3": dict(_BASE, model_type="gemma3_text", num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=16.0,
                   sliding_window=16, sliding_window_pattern=2),
    "phi3": dict(_BASE, model_type="phi3"),
    "olmo2": dict(_BASE, model_type="olmo2"),
    # Multi-head latent attention: the cache holds one latent "head" plus the RoPE key part.
    "deepseek_v3": dict(_BASE, model_type="deepseek_v3", num_key_value_heads=4, moe_intermediate_size=32,
                        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                        kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16),
    # Attention sinks (per-head sink logits), alternating sliding / full layers, MoE.
    "gpt_oss": dict(_BASE, model_type="gpt_oss", intermediate_size=64, head_dim=16, num_local_experts=4,
                    num_experts_per_tok=2, sliding_window=16, layer_types=["sliding_attention", "full_attention"]),
}


def tiny_model(arch: str, seed: int = 0, **overrides):
    """A tiny model of `arch` (a CONFIGS key); `overrides` change its config (e.g. head_dim=64)."""
    config = {**CONFIGS[arch], **overrides}
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    if arch == "gpt_oss":
        # Sinks start at zero; random ones make the test see them.
        for layer in model.layers:
            layer.self_attn.sinks = mx.random.normal(layer.self_attn.sinks.shape)
    # Random init is near-uniform attention; a larger scale makes attention peaky, as in trained models.
    model.update(_scaled(model.parameters(), 2.0))
    mx.eval(model.parameters())
    return model


def _scaled(tree, factor):
    if isinstance(tree, dict):
        return {k: _scaled(v, factor) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_scaled(v, factor) for v in tree]
    if isinstance(tree, mx.array) and tree.ndim == 2 and mx.issubdtype(tree.dtype, mx.floating):
        return tree * factor
    return tree
