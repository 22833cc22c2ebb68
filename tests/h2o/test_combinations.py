"""Every policy, and the h2o cache's parts one at a time and crossed, through the public API only
(`mlx_h2o.make_cache`, mlx-lm's save/load_prompt_cache, the tiny models):

1. exact while nothing is evicted: with a budget larger than the text, the logits equal those of
   mlx-lm's KVCache (float storage), or of a KVCache holding the rows rounded through mx.quantize
   to the cache's format (packed storage, float queries; rotated packed rows: no closer to the full
   cache than twice the error of that rounding);
2. saved after evictions and loaded in a NEW process, a cache continues with the same tokens and
   logits as the one it was saved from (one process for every case);
3. never above the budget: while decoding token by token, no layer holds more than the budget
   (plus pinned entries); an archive (evicted_bits) holds no more bytes than M entries of its own
   format.

Contradictory options are at the end: each raises a ValueError naming both."""

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from attention_reference import float_queries
from attention_reference import reference as float64_attention
from decoding import continue_in_new_process, greedy, prefill, step_logits, tokens
from mlx_lm.models import cache as lm_cache
from tiny_models import tiny_model

import mlx_h2o
from mlx_h2o.caches.h2o.lane import join_outputs
from mlx_h2o.caches.h2o.storage import DEFAULT_GROUP_SIZE

MODEL = dict(head_dim=64, hidden_size=128, max_position_embeddings=1024)  # head dim 64: every group size divides it
M, LARGE = 16, 256  # the budget of bounded cases; one larger than any text here (nothing evicted)
# Tokens: the prompt (<= M), decoded one at a time (past M and a full 2-bit archive), continued after saving.
PROMPT, DECODE, CONTINUE = 8, 64, 8
EXACT_TOKENS = 48  # tokens of the exactness check (< the recent window at LARGE: packed rows all in the recent tier)
PIN = [(2, 6)]

H2O = [
    # scorer
    dict(score="normalised"), dict(score="cumulative"), dict(score="ema"), dict(score="logit_ema"),
    dict(expected=0.5), dict(redundancy=0.5), dict(pool=3), dict(chunk=4), dict(obs_window=4),
    # budget
    dict(select="layer"), dict(layer_budget="pyramid"), dict(layer_budget="dispersion"), dict(head_budget="adaptive"),
    dict(split="balanced"), dict(split="recent"), dict(split="explicit", sink=2, heavy=10, recent=4), dict(evict_every=4),
    dict(pin=PIN, evict_every=4),
    # keeper
    dict(merge=0.5), dict(evicted_bits=2), dict(evicted_bits=4), dict(evicted_bits="k8v4", evicted_share=0.25),
    # storage
    dict(kv_bits=8), dict(kv_bits=4), dict(kv_bits="mixed"), dict(kv_bits="k8v4"), dict(rotate=True), dict(kv_bits=4, rotate=True),
    dict(kv_bits="mixed", kv_sink_rows=2, center_keys=True, rotate=True),
    # crossed
    dict(head_budget="adaptive", kv_bits="mixed"), dict(head_budget="adaptive", layer_budget="pyramid", chunk=4),
    dict(evicted_bits=2, kv_bits="mixed", rotate=True), dict(select="layer", evicted_bits=4), dict(select="layer", merge=0.5),
    dict(merge=0.5, kv_bits=8), dict(expected=0.5, redundancy=0.5, chunk=4), dict(obs_window=4, pool=3, layer_budget="dispersion"),
    dict(kv_bits="k8v4", layer_budget="pyramid", pin=PIN), dict(evicted_bits=4, score="ema", chunk=4),
    # per-head budgets with every other part (each head a lane of its own)
    dict(head_budget="adaptive", evicted_bits=2), dict(head_budget="adaptive", rotate=True),
    dict(head_budget="adaptive", kv_bits=4, rotate=True), dict(head_budget="adaptive", merge=0.5),
    dict(head_budget="adaptive", obs_window=4), dict(head_budget="adaptive", expected=0.5, redundancy=0.5),
    dict(evicted_bits=4, layer_budget="pyramid"), dict(head_budget="adaptive", evicted_bits=2, kv_bits="mixed", rotate=True),
]


def _id(name, opts):
    shown = [f"{k}={v}" for k, v in opts.items() if k != "max_kv_size"]
    return "-".join([name] + [s.replace(" ", "").replace("[(", "").replace(")]", "").replace(",", ":") for s in shown])


def _cases():
    out = []
    for name, policy in sorted(mlx_h2o.POLICIES.items()):
        needed = [o.name for o in policy.options if o.required]
        assert set(needed) <= {"max_kv_size"}, f"tell test_combinations how to fill {needed} of {name!r}"
        out.append((name, {"max_kv_size": M} if policy.bounded else {}))
    out += [("h2o", {"max_kv_size": M, **o}) for o in H2O]
    return [pytest.param(name, opts, id=_id(name, opts)) for name, opts in out]


CASES = _cases()
BOUNDED = [c for c in CASES if mlx_h2o.POLICIES[c.values[0]].bounded]


def _model():
    return tiny_model("llama", **MODEL)


def _with_budget(opts, budget):
    """opts with max_kv_size = budget (an explicit split keeps its sink and heavy counts)."""
    if "max_kv_size" not in opts:
        return opts
    out = {**opts, "max_kv_size": budget}
    if out.get("split") == "explicit":
        out["recent"] = budget - out["sink"] - out["heavy"]
    return out


# ----------------------------------------------------------------------------- 1. exact while nothing is evicted
class RoundedKVCache(lm_cache.KVCache):
    """mlx-lm's KVCache holding the rows rounded through mx.quantize (keys and values at their own
    bits): what a packed cache's attention must equal when its kernel dots float queries."""

    def __init__(self, k_bits, v_bits, group_size):
        super().__init__()
        self.formats = ((k_bits, v_bits), group_size)  # not `bits`: mlx-lm would take it for its quantized cache

    def update_and_fetch(self, keys, values):
        (k_bits, v_bits), g = self.formats

        def rounded(x, bits):
            return mx.dequantize(*mx.quantize(x, group_size=g, bits=bits), group_size=g, bits=bits).astype(x.dtype)

        return super().update_and_fetch(rounded(keys, k_bits), rounded(values, v_bits))


# The format of the rows while nothing is evicted: the recent tier's (LARGE's recent window holds the text).
H2O_ROWS = {8: (8, 8), 4: (4, 4), "k8v4": (8, 4), "mixed": (8, 8)}


def _packed_rows(name, opts):
    """((k bits, v bits), group size, rotated) of a case's stored rows, or None for float rows."""
    defaults = {o.name: o.default for o in mlx_h2o.POLICIES[name].options}
    opts = {**defaults, **opts}
    if name == "quantized":
        return (opts["bits"],) * 2, opts["group_size"], False
    if name == "rotated":
        return (opts["bits"],) * 2, opts["group_size"], True
    if name == "h2o" and opts["kv_bits"] is not None:
        return H2O_ROWS[opts["kv_bits"]], opts["kv_group_size"] or DEFAULT_GROUP_SIZE, opts["rotate"]
    return None


@pytest.fixture(scope="module")
def exact_run():
    """The tiny model, the text, and its per-step logits through a KVCache (float rows) or a
    RoundedKVCache of a given format."""
    model = _model()
    x = tokens(EXACT_TOKENS, seed=1, batch=2)
    refs = {}

    def reference(rows=None):
        if rows not in refs:
            cache = lm_cache.make_prompt_cache(model) if rows is None else [RoundedKVCache(*rows[0], rows[1]) for _ in model.layers]
            refs[rows] = step_logits(model, x, cache)
        return refs[rows]

    return model, x, reference


@pytest.mark.parametrize("name, opts", CASES)
def test_exact_while_nothing_is_evicted(exact_run, name, opts):
    model, x, reference = exact_run
    cache = mlx_h2o.make_cache(model, name, **_with_budget(opts, LARGE))
    _logits_match_the_full_cache(model, x, cache, name, opts, reference)
    if name == "h2o":
        _attention_matches_float64(cache)


def _logits_match_the_full_cache(model, x, cache, name, opts, reference):
    full = reference()
    packed = _packed_rows(name, opts)
    if packed is None:
        got = step_logits(model, x, cache)
        np.testing.assert_allclose(got, full, atol=1e-4 * max(1.0, np.abs(full).max()))
        return
    rows, group, rotated = packed
    rounded = reference((rows, group))
    if rotated:  # rounded in the rotated space: as close to the full cache as rounding in its own, within 2x
        got = step_logits(model, x, cache)
        bound = np.abs(rounded - full).max()
        assert 0.2 * bound < np.abs(got - full).max() < 2 * bound
        return
    with float_queries():
        got = step_logits(model, x, cache)
    np.testing.assert_allclose(got, rounded, atol=1e-3 * max(1.0, np.abs(rounded).max()))
    assert np.abs(rounded - full).max() > 10 * np.abs(got - rounded).max()  # the rows really are packed


def _attention_matches_float64(cache):
    """One more query through each h2o layer (nothing evicted) equals float64 attention (NumPy) over
    the rows its lanes hold, read back dense in the stored space (rotated storage: the query rotated
    in, the output rotated back), float queries for packed keys."""
    rng = np.random.default_rng(7)
    for c in cache:
        B, H = c.shape
        Hq, D = 2 * H, c.head_dims[0]  # the tiny model: 2 query heads per kv head
        q = mx.array(rng.standard_normal((B, Hq, 1, D)).astype(np.float32))
        fetched = c.lanes[0].store.fetch() if len(c.lanes) == 1 else (c.lanes, None)
        with float_queries():
            got = np.array(c.attend(q, *fetched, scale=D**-0.5))
        want = []
        for lane in c.lanes:
            keys, values = lane.store.read_rows()
            out, _, _ = float64_attention(lane.store.prepare_queries(lane.queries_of(q, H)), keys, values, D**-0.5)
            want.append(lane.store.restore_output(mx.array(out.astype(np.float32)), q.dtype))
        want = np.array(join_outputs(want, c.shape))
        assert c.evictions == 0
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- 2. and 3. evicted, saved, continued in a new process
def _decode_and_save(model, name, opts, seed, path):
    """Prefill, decode DECODE tokens one at a time (the sizes and bytes held after every step),
    save, continue CONTINUE tokens."""
    cache = mlx_h2o.make_cache(model, name, **opts)
    y = prefill(model, cache, tokens(PROMPT, seed=seed).tolist())
    sizes, nbytes = [], []
    for _ in range(DECODE):
        (y,), _ = greedy(model, cache, y, 1)
        sizes.append([c.size() for c in cache])
        nbytes.append([c.nbytes for c in cache])
    held, seen = [c.size() for c in cache], [c.offset for c in cache]
    lm_cache.save_prompt_cache(path, cache)
    chosen, logits = greedy(model, cache, y, CONTINUE)
    return SimpleNamespace(sizes=sizes, nbytes=nbytes, held=held, seen=seen, last=y, tokens=chosen, logits=logits)


@pytest.fixture(scope="module")
def continued(tmp_path_factory):
    """Every case decoded past its budget, saved and continued here; then every saved cache loaded
    and continued in ONE new process. {case id: the run (or the exception the case raised)}."""
    tmp = tmp_path_factory.mktemp("combinations")
    model = _model()
    runs, jobs = {}, []
    for i, case in enumerate(CASES):
        name, opts = case.values
        path = str(tmp / f"case{i}.safetensors")
        try:
            runs[case.id] = _decode_and_save(model, name, opts, i, path)
        except Exception as e:  # raised again by the case's tests
            runs[case.id] = e
            continue
        jobs.append({"case": case.id, "path": path, "last": runs[case.id].last})
    for job in continue_in_new_process(jobs, CONTINUE, tmp, "llama", **MODEL):
        runs[job["case"]].new_process = job
    return runs


def _run(continued, name, opts):
    run = continued[_id(name, opts)]
    if isinstance(run, Exception):
        raise run
    return run


@pytest.mark.parametrize("name, opts", CASES)
def test_saved_cache_continues_identically_in_a_new_process(continued, name, opts):
    run = _run(continued, name, opts)
    if mlx_h2o.POLICIES[name].bounded:  # saved after evictions: fewer entries held than tokens seen
        assert all(h < s for h, s in zip(run.held, run.seen)), (run.held, run.seen)
    assert run.new_process["tokens"] == run.tokens
    np.testing.assert_allclose(run.new_process["logits"], run.logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name, opts", BOUNDED)
def test_never_above_the_budget(continued, name, opts):
    run = _run(continued, name, opts)
    pinned = sum(e - s for s, e in opts.get("pin", ()))
    layers = len(run.sizes[0])
    for step, sizes in enumerate(run.sizes):
        if opts.get("layer_budget", "uniform") == "uniform":
            assert max(sizes) <= M + pinned, (step, sizes)
        else:  # budgets move between layers at the same total
            assert sum(sizes) <= layers * (M + pinned), (step, sizes)
    if "evicted_bits" in opts:
        # The bytes of M entries in the cache's own format: the same cache without the archive, holding M.
        model = _model()
        plain = mlx_h2o.make_cache(model, name, **{k: v for k, v in opts.items() if not k.startswith("evicted")})
        model(tokens(M, batch=1), cache=plain)
        assert all(c.size() == M for c in plain)
        # A layer's bytes: its own budget (layer_budget moves M between layers) of entries of that format.
        limit = [c.nbytes // M * c.layer_budget.max_kv_size for c in plain]
        for step, nbytes in enumerate(run.nbytes):
            assert all(n <= m for n, m in zip(nbytes, limit)), (step, nbytes, limit)
        assert all(n >= 0.85 * m for n, m in zip(run.nbytes[-1], limit))  # and the archive did fill up


# ----------------------------------------------------------------------------- contradictions
CONTRADICTIONS = [
    (dict(head_budget="adaptive", select="layer"), ("head_budget", "select")),  # per-head budgets vs one set per layer
    (dict(evicted_bits=4, merge=0.5), ("evicted_bits", "merge")),  # an evicted entry is merged or archived, not both
    (dict(layer_budget="dispersion", score="logit_ema"), ("dispersion", "logit_ema")),  # entropy of mass vs logits
    (dict(evicted_bits=4, evicted_share=0.9), ("evicted_share", "sink")),  # no room left beyond the sink
]


@pytest.mark.parametrize("options, names", CONTRADICTIONS, ids=[_id("h2o", o) for o, _ in CONTRADICTIONS])
def test_contradictory_options_raise_a_readable_error(options, names):
    """The message names both sides of the contradiction."""
    with pytest.raises(ValueError, match="(?s)" + "".join(f"(?=.*{n})" for n in names)):
        mlx_h2o.make_cache(_model(), "h2o", max_kv_size=M, **options)
