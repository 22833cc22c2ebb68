"""The recall suite (needle with decoy and paraphrase, passkey, span at equal bytes) and the demo."""

import re
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from tiny_models import tiny_model

import mlx_h2o
from mlx_h2o.evaluation.demo import demo_markdown, plot_demo, run_demo
from mlx_h2o.evaluation.memory import kv_bytes
from mlx_h2o.evaluation.recall import LEAD, recall_sequences
from mlx_h2o.evaluation.retrieval import (NEEDLES, RetrievalTrial, add_survived, answer_hit, greedy_answers,
                                          retrieval_table, retrieval_trials)
from mlx_h2o.evaluation.runner import parse_specs
from mlx_h2o.evaluation.suite import CACHES, _span_survived, equal_byte_specs, full_bytes_per_token, parse_caches, suite_markdown

MODEL = dict(head_dim=32)  # packed rows need whole groups of 32


def _docs(n=4, length=400, seed=0):
    rng = np.random.default_rng(seed)
    return [(f"doc{i}", rng.integers(0, 128, length).tolist()) for i in range(n)]


# ----------------------------------------------------------------------------- retrieval trials
@pytest.fixture(scope="module")
def real_docs(smollm):
    from mlx_h2o.evaluation import load_corpus
    from mlx_h2o.evaluation.corpus import document_set

    _, tokenizer = smollm
    return document_set(tokenizer, load_corpus(), 0)


@pytest.mark.parametrize("context", [300, 1000, 5000])
def test_retrieval_trials_are_exactly_the_context_with_needle_and_decoy(smollm, real_docs, context):
    """Every prompt is `context` tokens (5000 is more than any single document of the set: the haystack
    joins documents), holds its needle (and the needle's decoy, another number) near its depth, and
    ends with the question in the chat template."""
    _, tokenizer = smollm
    trials = retrieval_trials(tokenizer, real_docs, context, depths=(0.2, 0.8), per_depth=2, seed=3)
    assert [t.probe for t in trials] == ["needle"] * 4 + ["passkey"] * 4
    for t in trials:
        assert len(t.prompt) == context
        text = tokenizer.decode(t.prompt)
        assert text.count(t.answer) >= 1 and text.rstrip().endswith("assistant")
        # Near its depth: off by the sentence-boundary search (<= 64 tokens) and the frame around the haystack.
        slack = 0.1 + 64 / context + 0.15 * (context < 1000)
        at = text.index(t.answer) / len(text)
        assert abs(at - t.depth) < slack, (t.depth, at)
        if t.probe == "needle":
            assert t.decoy != t.answer and t.decoy in text
            needle, decoy, question = next(n for n in NEEDLES if n[0].format(v=t.answer) in text)
            assert decoy.format(d=t.decoy) in text and question in text
            assert abs(text.index(t.decoy) / len(text) - (t.depth + 0.5) % 1.0) < slack
        else:
            assert t.decoy is None and "pass key" in text
    # Seeded: the same trials again.
    assert [t.prompt for t in retrieval_trials(tokenizer, real_docs, context, depths=(0.2, 0.8), per_depth=2, seed=3)] == \
        [t.prompt for t in trials]


@pytest.mark.parametrize("bad, match", [(dict(context=100), "context"), (dict(per_depth=0), "per_depth"),
                                        (dict(depths=(1.5,)), "depths"), (dict(probes=("needle", "riddle")), "probes")])
def test_retrieval_trials_reject_bad_arguments(smollm, real_docs, bad, match):
    _, tokenizer = smollm
    with pytest.raises(ValueError, match=match):
        retrieval_trials(tokenizer, real_docs, **{**dict(context=512), **bad})


def test_answer_hit_needs_the_needle_and_not_the_decoy():
    t = RetrievalTrial("needle", "d", 0.5, "4721", "8390", [])
    assert answer_hit(t, "platform 4721.")
    assert not answer_hit(t, "platform 8390.")
    assert not answer_hit(t, "4721 or 8390")
    assert not answer_hit(t, "472")
    assert answer_hit(RetrievalTrial("passkey", "d", 0.5, "12345", None, []), "The pass key is 12345.")


def test_add_survived_counts_only_what_the_full_cache_finds():
    rows = [
        dict(policy="full", probe="needle", context=64, hits=[True, True, False, True]),
        dict(policy="h2o", probe="needle", context=64, hits=[True, False, True, True]),
        dict(policy="h2o", probe="passkey", context=64, hits=[True]),
        dict(policy="full", probe="passkey", context=64, hits=[False]),
    ]
    add_survived(rows)
    assert rows[1]["survived"] == pytest.approx(2 / 3) and rows[1]["full_hits"] == 3
    assert rows[0]["survived"] == 1.0
    assert rows[2]["survived"] is None  # the full cache found nothing: nothing to survive


def test_greedy_answers_through_the_cache_are_the_model_s_greedy_tokens():
    """Fed token by token through the full cache, the answers are the greedy continuation computed
    from the whole sequence each step (no cache)."""
    model = tiny_model("llama", **MODEL)
    x = np.random.default_rng(4).integers(0, 128, (3, 40)).astype(np.int32)
    got = greedy_answers(model, x, mlx_h2o.make_cache(model, "full"), max_tokens=5, prefill=8)
    seq = mx.array(x)
    for _ in range(5):
        seq = mx.concatenate([seq, mx.argmax(model(seq)[:, -1, :], axis=-1)[:, None]], axis=1)
    np.testing.assert_array_equal(got, np.array(seq[:, 40:]))


class _Digits:
    """A tokenizer for a tiny model: token k is the text of k (so any answer decodes)."""

    eos_token_ids = [0]

    def decode(self, ids):
        return " ".join(str(i) for i in ids)


def test_retrieval_table_batches_policies_as_each_alone():
    model = tiny_model("llama", **MODEL)
    rng = np.random.default_rng(5)
    trials = [RetrievalTrial("needle", f"d{i}", 0.5, "7", "9", rng.integers(1, 128, 60).tolist()) for i in range(3)]
    specs = parse_specs(["full", "rotating:max_kv_size=16", "h2o:max_kv_size=16"])
    together = retrieval_table(model, _Digits(), specs, trials, max_tokens=4, prefill=8, progress=False)
    for spec, row in zip(specs, together):
        alone = retrieval_table(model, _Digits(), [spec], trials, max_tokens=4, prefill=8, progress=False)[0]
        assert alone["answers"] == row["answers"] and alone["hits"] == row["hits"]
    assert together[0]["survived"] in (None, 1.0)
    with pytest.raises(ValueError, match="one context length"):
        retrieval_table(model, _Digits(), specs, trials + [RetrievalTrial("needle", "x", 0.5, "1", None, [1] * 10)], progress=False)


# ----------------------------------------------------------------------------- equal bytes
@pytest.mark.default_kv_dtype
def test_equal_byte_specs_hold_the_bytes_they_are_given():
    """Every cache of a fraction holds at most that fraction of the full cache's bytes at the context,
    after a prompt fed in chunks and decoding; the fp window is the entries those bytes buy. The
    reference and the windows keep the model's float32 rows, whatever the policies' default."""
    model = tiny_model("llama", **MODEL)
    token = full_bytes_per_token(model)
    context, fraction = 200, 0.25
    specs = equal_byte_specs(model, context, [fraction])
    assert [s.name for s in specs] == ["full"] + [c[0] for c in CACHES]
    budget = int(fraction * context * token)
    assert specs[1].options == {"max_kv_size": budget // token, "kv_dtype": "float32"}
    assert specs[0].options == {"kv_dtype": "float32"} and specs[2].options["kv_dtype"] == "float32"
    x = mx.array(np.random.default_rng(6).integers(0, 128, (1, context)))
    held = {}
    for s in specs:
        cache = mlx_h2o.make_cache(model, s.policy, **s.options)
        for i in range(0, context - 20, 30):
            model(x[:, i : min(i + 30, context - 20)], cache=cache)
        for t in range(context - 20, context):
            mx.eval(model(x[:, t : t + 1], cache=cache))
        held[s.name] = kv_bytes(cache)
    assert held["full"] == context * token
    for name in held:
        if name != "full":
            assert 0 < held[name] <= budget, name
    with pytest.raises(ValueError, match="fractions"):
        equal_byte_specs(model, context, [1.5])


def test_window_split_is_a_sliding_window_with_sinks():
    """split=window keeps no heavy hitters: the sinks and the newest tokens, like split=explicit with
    heavy=0, whatever attention says."""
    model = tiny_model("llama", **MODEL)
    x = mx.array(np.random.default_rng(7).integers(0, 128, (1, 90)))
    outs = []
    for options in (dict(split="window"), dict(split="explicit", sink=4, heavy=0, recent=28)):
        cache = mlx_h2o.make_cache(model, "h2o", max_kv_size=32, evict_every=1, **options)
        steps = [model(x[:, t : t + 1], cache=cache) for t in range(90)]
        mx.eval(steps)
        outs.append(mx.concatenate(steps, axis=1))
        positions = np.sort(np.array(cache[0].positions)[0, 0]) if hasattr(cache[0], "positions") else None
        if positions is not None:
            np.testing.assert_array_equal(positions, list(range(4)) + list(range(90 - 28, 90)))
    np.testing.assert_allclose(np.array(outs[0]), np.array(outs[1]), rtol=1e-5, atol=1e-5)
    cache = mlx_h2o.make_cache(model, "h2o", max_kv_bytes=40_000, split="window", kv_bits="8")
    mx.eval(model(x, cache=cache))
    assert kv_bytes(cache) <= 40_000


# ----------------------------------------------------------------------------- span probe, tables, plot
def test_recall_filler_joins_documents_when_one_is_too_short():
    docs = _docs(4, length=400)
    seq = recall_sequences(docs, span=16, filler=700, trials=1)[0]
    assert seq.filler_doc == "doc2+doc3" and len(seq.tokens) == LEAD + 16 + 700 + 16
    assert seq.tokens[LEAD + 16 : LEAD + 16 + 400] == docs[2][1]
    assert seq.tokens[LEAD + 16 + 400 : seq.repeat_start] == docs[3][1][:300]
    with pytest.raises(ValueError, match="sharing no"):
        recall_sequences(docs, span=16, filler=5000, trials=1)


def test_span_survived_uses_the_fp_window_of_the_same_bytes():
    rows = [dict(cache="full", policy="full", fraction=1.0, nll=1.0), dict(cache="window fp", policy="rotating", fraction=0.1, nll=3.0),
            dict(cache="h2o", policy="h2o", fraction=0.1, nll=1.5), dict(cache="window fp", policy="rotating", fraction=0.2, nll=2.0),
            dict(cache="h2o", policy="h2o", fraction=0.2, nll=2.5)]
    _span_survived(rows, 64)
    assert [r["survived"] for r in rows] == [1.0, 0.0, pytest.approx(0.75), 0.0, pytest.approx(-0.5)]
    table = suite_markdown([{**r, "context": 64, "trials": 4} for r in rows])
    assert "| 10 % | h2o | 75 % |" in table and "| 100 % | full | NLL 1.00 |" in table


def test_run_demo_on_a_tiny_model(tmp_path):
    """The demo's rows: the full cache is the reference (ΔPPL 0, every token fed but the last, which is
    only a target), every other cache holds at most its budget, the middle budget's caches were timed;
    the table and the plot are written."""
    model = tiny_model("llama", **MODEL)
    docs = _docs(4, length=700)
    said = []
    rows = run_demo(model, docs, context=600, fractions=(0.25, 0.5), samples=2, span_trials=2, speed_steps=3,
                    progress=False, say=said.append)
    token = full_bytes_per_token(model)
    full = next(r for r in rows if r["cache"] == "full")
    assert full["delta_pct"] == 0.0 and full["kv_bytes_per_seq"] == 599 * token and full["recall"] == 1.0
    assert len(rows) == 7 and said
    for r in rows:
        if r["cache"] != "full":
            assert r["kv_bytes_per_seq"] <= r["fraction"] * 600 * token
            assert ("decode_tok_s" in r) == (r["fraction"] == 0.5)
            assert r["verdict"].startswith(f"{r['delta_pct']:+.1f} % PPL")
    table = demo_markdown(rows)
    assert table.count("\n") == 8 and "the reference" in table
    assert plot_demo(rows, str(tmp_path / "demo.png")) and (tmp_path / "demo.png").stat().st_size > 10_000
    with pytest.raises(ValueError, match="context"):
        run_demo(model, docs, context=300, progress=False)


def test_recall_suite_compares_the_caches_given():
    """--cache NAME=SPEC: the suite's specs are the full cache and these, filled in per budget."""
    model = tiny_model("llama", **MODEL)
    caches = parse_caches(["8-bit=h2o:max_kv_bytes={B},split=window,kv_bits=8", "tiers r8 = h2o:max_kv_bytes={B},kv_recent_rows=8"])
    assert caches == (("8-bit", "h2o:max_kv_bytes={B},split=window,kv_bits=8"), ("tiers r8", "h2o:max_kv_bytes={B},kv_recent_rows=8"))
    specs = equal_byte_specs(model, 400, [0.25], caches)
    budget = int(0.25 * 400 * full_bytes_per_token(model))
    assert [(s.name, s.policy, s.options.get("max_kv_bytes")) for s in specs] == [
        ("full", "full", None), ("8-bit", "h2o", budget), ("tiers r8", "h2o", budget)]
    assert specs[2].options["kv_recent_rows"] == 8


@pytest.mark.parametrize("argv, match", [(["recall-suite", "--budget", "1.5"], "fractions"),
                                         (["recall-suite", "--cache", "h2o"], "--cache takes NAME=SPEC"),
                                         (["recall-suite", "--cache", "a=h2o:max_kv_bytes={X}"], r"only \{B\} \(bytes\), \{M\}"),
                                         (["recall-suite", "--cache", "a=h2o:max_kv_bytes={B},kv_recent_rows=0"], "kv_recent_rows"),
                                         (["recall-suite", "--cache", "a=h2o:max_kv_bytes={B}", "--cache", "a=full"], "names must differ"),
                                         (["recall-suite", "--cache", "a=h2o:max_kv_bytes={B}"], "span probe scores against the fp window"),
                                         (["demo", "--context", "100"], "context")])
def test_commands_reject_bad_budgets_and_contexts(argv, match):
    r = subprocess.run([sys.executable, "-m", "mlx_h2o", *argv, "--quiet"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and re.search(match, r.stderr) and "Traceback" not in r.stderr
