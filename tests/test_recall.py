"""The recall probe, disjoint document sets, and policies decoded together in one batch."""

import json

import mlx.core as mx
import numpy as np
import pytest
from tiny_models import tiny_model

import mlx_h2o
from mlx_h2o.evaluation import autoregressive_nll, load_corpus, teacher_forced_nll, token_samples
from mlx_h2o.evaluation.batched import policy_batch, policy_kv_bytes
from mlx_h2o.evaluation.corpus import SET_DOCS, SET_MIN_TOKENS, document_set, set_samples
from mlx_h2o.evaluation.recall import LEAD, NGRAM, SPAN_OFFSET, add_recovered, recall_sequences, recall_table, repeat_nll
from mlx_h2o.evaluation.runner import parse_specs, perplexity_table

SPECS = ["full", "rotating:max_kv_size=24", "h2o:max_kv_size=24", "h2o:max_kv_size=20,evict_every=3,kv_bits=8"]
MODEL = dict(head_dim=32)  # packed rows need whole groups of 32


def _docs(n=4, length=400, seed=0):
    rng = np.random.default_rng(seed)
    return [(f"doc{i}", rng.integers(0, 128, length).tolist()) for i in range(n)]


# ----------------------------------------------------------------------------- policy batches
@pytest.mark.parametrize("chunk", [None, 7])
def test_policy_batch_equals_each_policy_alone(chunk):
    """Rows of a batch never interact: every policy's NLLs are those of a run of its own, also when
    chunks arrive while the policies hold different numbers of entries (per-policy masks)."""
    model = tiny_model("llama", **MODEL)
    x = np.random.default_rng(1).integers(0, 128, (2, 90))
    specs = parse_specs(SPECS)
    caches = [mlx_h2o.make_cache(model, s.policy, **s.options) for s in specs]
    batch = policy_batch(caches, 2)
    both = repeat_nll(model, np.concatenate([x] * len(specs)), batch, 60, chunk=chunk, prefill=8)
    for i, s in enumerate(specs):
        alone = repeat_nll(model, x, mlx_h2o.make_cache(model, s.policy, **s.options), 60, chunk=chunk, prefill=8)
        np.testing.assert_allclose(both[2 * i : 2 * i + 2], alone, rtol=1e-4, atol=1e-4)
    # The bounded policies forgot something the full cache still sees.
    assert np.abs(both[2:4] - both[0:2]).max() > 1e-2
    sizes = [policy_kv_bytes(batch, i) for i in range(len(specs))]
    assert sizes[0] > sizes[1] > 0 and sizes[3] < sizes[2]


def test_perplexity_table_policy_batch_matches_one_at_a_time():
    model = tiny_model("llama", **MODEL)
    rng = np.random.default_rng(2)
    samples = [("a", rng.integers(0, 128, 70).tolist()), ("b", rng.integers(0, 128, 70).tolist())]
    specs = parse_specs(SPECS)
    one = perplexity_table(model, specs, samples, prefill=8, progress=False)
    together = perplexity_table(model, specs, samples, prefill=8, progress=False, policy_batch_size=3)
    for a, b in zip(one, together):
        assert a["label"] == b["label"]
        np.testing.assert_allclose(a["sample_ppl"], b["sample_ppl"], rtol=1e-5)
        assert a["kv_bytes_per_seq"] == b["kv_bytes_per_seq"]
    assert [r["policies_batched"] for r in together] == [3, 3, 3, 1]
    with pytest.raises(ValueError, match="policy_batch_size"):
        perplexity_table(model, specs, samples, progress=False, policy_batch_size=0)


def test_perplexity_table_scores_after_the_prefill_for_kvpress_protocol():
    """score_after_prefill: the NLL of only the tokens predicted after the prefill call (kvpress's
    protocol, the context compressed once), the same values autoregressive_nll gives there."""
    model = tiny_model("llama", **MODEL)
    rng = np.random.default_rng(3)
    samples = [("a", rng.integers(0, 128, 61).tolist()), ("b", rng.integers(0, 128, 61).tolist())]
    specs = parse_specs(["full", "h2o"], [16])
    rows = perplexity_table(model, specs, samples, prefill=40, progress=False, score_after_prefill=True)
    for spec, row in zip(specs, rows):
        nll = autoregressive_nll(model, np.array([s[1] for s in samples]), mlx_h2o.make_cache(model, spec.policy, **spec.options),
                                 prefill=40)
        assert row["scored"] == 20 == nll[:, 40:].shape[1]
        np.testing.assert_allclose(row["sample_ppl"], np.exp(nll[:, 40:].mean(axis=1)), rtol=1e-5)
    assert rows[1]["delta_pct"] > 0  # h2o at M = 16 lost what the prefill's 40 tokens held


# ----------------------------------------------------------------------------- the probe
def test_recall_sequences_layout():
    docs = _docs(4)
    seqs = recall_sequences(docs, span=16, filler=50, trials=3)
    assert len(seqs) == 3
    for i, s in enumerate(seqs):
        span = docs[i][1][SPAN_OFFSET : SPAN_OFFSET + 16]
        assert s.tokens[:LEAD] == docs[i][1][SPAN_OFFSET - LEAD : SPAN_OFFSET]
        assert s.tokens[LEAD : LEAD + 16] == span == s.tokens[s.repeat_start :]
        assert s.repeat_start == LEAD + 16 + 50 and len(s.tokens) == s.repeat_start + 16
        assert s.filler_doc != s.doc and s.distance == 66
        assert s.tokens[LEAD + 16 : s.repeat_start] == dict(docs)[s.filler_doc][:50]
    assert [s.filler_doc for s in seqs] == ["doc2", "doc3", "doc0"]


def test_recall_filler_shares_no_ngram_with_its_span():
    docs = _docs(3)
    # doc1 (the first filler candidate for doc0's span) quotes doc0's span: it must be skipped.
    span = docs[0][1][SPAN_OFFSET : SPAN_OFFSET + 20]
    docs[1] = ("doc1", docs[1][1][:30] + span[:NGRAM] + docs[1][1][30 + NGRAM :])
    seq = recall_sequences(docs, span=20, filler=100, trials=1)[0]
    assert seq.filler_doc == "doc2"
    docs[2] = ("doc2", docs[2][1][:10] + span[3 : 3 + NGRAM] + docs[2][1][10 + NGRAM :])
    with pytest.raises(ValueError, match="sharing no"):
        recall_sequences(docs, span=20, filler=100, trials=1)


@pytest.mark.parametrize("bad, match", [(dict(span=0), "span"), (dict(filler=-1), "filler"), (dict(trials=5), "trials"),
                                        (dict(span=200), "too few")])
def test_recall_sequences_reject_bad_arguments(bad, match):
    with pytest.raises(ValueError, match=match):
        recall_sequences(_docs(4), **{**dict(span=16, filler=50, trials=2), **bad})


@pytest.mark.parametrize("chunk", [None, 16])
def test_repeat_nll_of_full_cache_is_teacher_forced(chunk):
    model = tiny_model("llama", **MODEL)
    seq = recall_sequences(_docs(2), span=12, filler=40, trials=2)
    x = np.array([s.tokens for s in seq])
    ref = teacher_forced_nll(model, x)[:, seq[0].repeat_start :]
    got = repeat_nll(model, x, mlx_h2o.make_cache(model, "full"), seq[0].repeat_start, chunk=chunk, prefill=8)
    assert got.shape == ref.shape == (2, 11)
    np.testing.assert_allclose(got, ref, atol=1e-4)
    with pytest.raises(ValueError, match="chunk"):
        repeat_nll(model, x, mlx_h2o.make_cache(model, "full"), seq[0].repeat_start, chunk=0)
    with pytest.raises(ValueError, match="repeat_start"):
        repeat_nll(model, x, mlx_h2o.make_cache(model, "full"), x.shape[1] - 1)


def test_recovered_share():
    rows = [dict(policy=p, max_kv_size=m, span=8, filler=10, chunk=None, nll=n)
            for p, m, n in [("full", None, 1.0), ("rotating", 4, 3.0), ("h2o", 4, 2.5), ("h2o", 8, 2.0), ("rotating", 8, 0.5)]]
    add_recovered(rows)
    assert rows[0]["recovered"] is None  # the full cache has no budget, hence no window to compare with
    assert rows[1]["recovered"] == 0.0 and rows[2]["recovered"] == pytest.approx(0.25)
    assert rows[3]["recovered"] is None  # the window beat the full cache: no gain to share


def test_probe_on_smollm_full_copies_window_forgets(smollm):
    """The 135M model copies a repeated span it still holds; a window that lost it cannot."""
    model, tokenizer = smollm
    docs = document_set(tokenizer, load_corpus(), 0)
    seqs = recall_sequences(docs, span=24, filler=96, trials=2)
    rows = recall_table(model, parse_specs(["full", "rotating", "h2o"], [64]), seqs, progress=False)
    full, window, h2o = (r["nll"] for r in rows)
    assert full < 0.5 * window
    assert rows[1]["recovered"] == pytest.approx(0.0) and rows[1]["window_nll"] == window and rows[2]["full_nll"] == full
    assert rows[2]["recovered"] is not None and rows[2]["kv_bytes_per_seq"] < rows[0]["kv_bytes_per_seq"]
    chunked = recall_table(model, parse_specs(["full", "rotating"], [64]), seqs, chunk=32, progress=False)
    assert chunked[0]["nll"] == pytest.approx(full, abs=1e-3) and chunked[0]["chunk"] == 32


# ----------------------------------------------------------------------------- document sets
def test_document_sets_are_disjoint_and_set0_is_the_legacy_sample(smollm):
    _, tokenizer = smollm
    corpus = load_corpus()
    sets = [document_set(tokenizer, corpus, k) for k in range(3)]
    names = [[n for n, _ in s] for s in sets]
    assert all(len(n) == SET_DOCS for n in names)
    assert len({n for s in names for n in s}) == 3 * SET_DOCS
    assert all(len(ids) >= SET_MIN_TOKENS for s in sets for _, ids in s)
    legacy = token_samples(tokenizer, corpus, 4, 2048)
    assert [n for n, _ in legacy] == names[0][:4]
    short = set_samples(tokenizer, corpus, 1, 3, 512)
    assert [n for n, _ in short] == names[1][:3] and all(len(ids) == 512 for _, ids in short)
    for bad, match in [(dict(index=-1), "doc set"), (dict(n_samples=SET_DOCS + 1), "n_samples"), (dict(length=4096), "length")]:
        with pytest.raises(ValueError, match=match):
            set_samples(tokenizer, corpus, **{**dict(index=0, n_samples=2, length=64), **bad})


def test_cli_recall_writes_rows(smollm, tmp_path, capsys):
    from mlx_h2o.cli import main

    out = tmp_path / "recall.json"
    assert main(["recall", "--kv-policy", "full", "rotating", "h2o:chunk=4", "--max-kv-size", "48", "--span", "12",
                 "--filler", "60", "--trials", "2", "--chunk", "16", "--quiet", "--doc-set", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["recall"]
    assert [r["label"] for r in rows] == ["full", "rotating(M=48)", "h2o(M=48,chunk=4)"]
    assert all(r["doc_set"] == 1 and r["chunk"] == 16 for r in rows)
    assert "recovered" in capsys.readouterr().out
