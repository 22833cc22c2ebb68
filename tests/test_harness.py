"""The measurement harness: the cache path is exact, corpora and options are validated."""

import math

import numpy as np
import pytest

import mlx_h2o
from mlx_h2o.evaluation import autoregressive_nll, load_corpus, teacher_forced_nll, token_samples
from mlx_h2o.evaluation.report import plot_sweep
from mlx_h2o.evaluation.runner import parse_specs, perplexity_table


def test_full_cache_autoregressive_equals_teacher_forced(smollm, licence_tokens):
    model, _ = smollm
    tokens = np.array([licence_tokens[:160], licence_tokens[300:460]])
    ref = teacher_forced_nll(model, tokens)
    got = autoregressive_nll(model, tokens, mlx_h2o.make_cache(model, "full"), prefill=32)
    assert got.shape == ref.shape == (2, 159)
    np.testing.assert_allclose(got, ref, atol=1e-3, rtol=0)
    assert abs(got.mean() - ref.mean()) / ref.mean() < 1e-4


def test_rotating_cache_exact_until_full_then_diverges(smollm, licence_tokens):
    model, _ = smollm
    tokens = np.array(licence_tokens[:120])
    full = autoregressive_nll(model, tokens, mlx_h2o.make_cache(model, "full"))
    big = autoregressive_nll(model, tokens, mlx_h2o.make_cache(model, "rotating", max_kv_size=128))
    small = autoregressive_nll(model, tokens, mlx_h2o.make_cache(model, "rotating", max_kv_size=40))
    np.testing.assert_allclose(big, full, atol=1e-3)
    np.testing.assert_allclose(small[:, :39], full[:, :39], atol=1e-3)  # nothing evicted yet
    assert np.abs(small[:, 60:] - full[:, 60:]).max() > 1e-2  # the window forgot something


def test_perplexity_table_and_plot(smollm, licence_tokens, tmp_path):
    model, _ = smollm
    samples = [("a", licence_tokens[:80]), ("b", licence_tokens[100:180])]
    rows = perplexity_table(model, parse_specs(["full", "rotating"], [24, 48]), samples, progress=False)
    assert [r["label"] for r in rows] == ["full", "rotating(M=24)", "rotating(M=48)"]
    assert rows[0]["delta_pct"] == 0.0
    assert rows[1]["kv_bytes_per_seq"] < rows[0]["kv_bytes_per_seq"]
    assert all(math.isfinite(r["ppl"]) for r in rows)
    assert plot_sweep(rows, str(tmp_path / "sweep.png"))
    assert (tmp_path / "sweep.png").stat().st_size > 1000


def test_token_samples_come_from_different_documents(smollm):
    _, tokenizer = smollm
    corpus = load_corpus()
    samples = token_samples(tokenizer, corpus, 4, 512)
    assert len({name for name, _ in samples}) == 4
    assert all(len(ids) == 512 for _, ids in samples)
    with pytest.raises(ValueError, match="n_samples"):
        token_samples(tokenizer, corpus, 0, 512)


def test_user_text_files(tmp_path, smollm):
    _, tokenizer = smollm
    missing = tmp_path / "missing.txt"
    with pytest.raises(ValueError, match="not found"):
        load_corpus([str(missing)])
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00 not utf-8 \xc3\x28")
    with pytest.raises(ValueError, match="cannot read"):
        load_corpus([str(binary)])
    short = tmp_path / "short.txt"
    short.write_text("only a few words")
    with pytest.raises(ValueError, match="only 0 documents"):
        token_samples(tokenizer, load_corpus([str(short)]), 1, 100)


def test_stdlib_fallback_corpus_has_text():
    from mlx_h2o.evaluation.corpus import _stdlib_docstring_corpus

    corpus = _stdlib_docstring_corpus()
    assert len(corpus.documents) > 20
    assert "python3-doc not found" in corpus.name


def test_bad_policy_specs_and_sizes(smollm):
    model, _ = smollm
    with pytest.raises(ValueError, match="policy must be one of"):
        mlx_h2o.make_cache(model, "lru")
    for bad in (0, -3, 2.5, None, True):
        with pytest.raises(ValueError, match="max_kv_size"):
            mlx_h2o.make_cache(model, "rotating", max_kv_size=bad)
    with pytest.raises(ValueError, match="unknown option\\(s\\) max_kv_size for policy 'full'; its options: kv_dtype"):
        mlx_h2o.make_cache(model, "full", max_kv_size=8)
    with pytest.raises(ValueError, match="policy must be one of"):
        parse_specs(["nope"])
    with pytest.raises(ValueError, match="needs a budget"):
        parse_specs(["rotating"])
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_specs(["rotating:128"])
    assert parse_specs(["rotating:max_kv_size=64,keep=2"])[0].options == {"max_kv_size": 64, "keep": 2}


def test_decode_benchmark_reports_a_consistent_distribution():
    from tiny_models import tiny_model

    from mlx_h2o.evaluation import decode_benchmark

    model = tiny_model("llama")
    tokens = np.random.default_rng(0).integers(0, 128, 300)
    cache = mlx_h2o.make_cache(model, "full")
    r = decode_benchmark(model, cache, tokens, steps=12, prefill_chunk=128)
    assert r["context"] == 300 and r["steps"] == 12
    assert 0 < r["p50_ms"] <= r["p99_ms"] <= r["max_ms"]
    assert r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0
    # The cache holds the 299 prefilled tokens plus the 12 decoded ones; K and V, fp32.
    layers, kv_heads, head_dim = 2, 2, 16
    assert cache[0].offset == 299 + 12
    assert r["kv_bytes"] == layers * 2 * kv_heads * (299 + 12) * head_dim * 4
    with pytest.raises(ValueError, match="context_tokens"):
        decode_benchmark(model, mlx_h2o.make_cache(model, "full"), np.array([], dtype=np.int64))
