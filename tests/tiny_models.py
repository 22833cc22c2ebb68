"""Tiny random-weight mlx-lm models for fast tests (no download, seconds to run)."""

import importlib

import mlx.core as mx


def tiny_model(model_type, **extra):
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    base = dict(
        model_type=model_type, hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=101, head_dim=16, rope_theta=10000.0,
        max_position_embeddings=512, tie_word_embeddings=True,
    )
    base.update(extra)
    args = module.ModelArgs.from_dict(base)
    mx.random.seed(0)
    model = module.Model(args)
    mx.eval(model.parameters())
    return model


