"""The h2o policy's options (caches/h2o/options.py): clear errors for bad values, the split presets,
and option specs as the evaluation runner parses them."""

import pytest
from tiny_models import tiny_model

import mlx_h2o
from mlx_h2o.caches.h2o import H2OConfig


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(split="wide"), r"split must be one of 'heavy', 'balanced', 'recent', 'window', 'explicit', got 'wide'"),
        (dict(score="lru"), r"score must be one of 'cumulative', 'ema', 'logit_ema', 'normalised'"),
        (dict(select="token"), r"select must be one of 'head', 'layer'"),
        (dict(evict_every=0), r"evict_every must be an integer >= 1"),
        (dict(evict_every=61), r"evict_every must be an integer in \[1, 60\]"),
        (dict(sink=64), r"sink must be an integer in \[0, 63\]"),
        (dict(split="explicit", heavy=10), "split='explicit' needs heavy and recent"),
        (dict(split="explicit", heavy=10, recent=10), "sink \\+ heavy \\+ recent must equal max_kv_size=64"),
        (dict(heavy=10), "give split='explicit'"),
        (dict(score="cumulative", decay=0.9), "decay applies to score in"),
        (dict(score="ema", decay=1.5), r"decay must be a number in \[0.0, 1.0\)"),
        (dict(pin=[(5, 2)]), "pin must be"),
        (dict(pin="a:b"), "pin must be START:END"),
        (dict(obs_window=-1), "obs_window must be"),
        (dict(pool=0), r"pool must be an integer >= 1"),
        (dict(budget=3), r"unknown option\(s\) budget for policy 'h2o'; its options: max_kv_size, split"),
        (dict(max_kv_size=0), "max_kv_size must be an integer >= 1"),
    ],
)
def test_bad_options_raise_value_error(options, match):
    model = tiny_model("llama")
    options = {"max_kv_size": 64, **options}
    with pytest.raises(ValueError, match=match):
        mlx_h2o.make_cache(model, "h2o", **options)


def test_eval_spec_and_presets():
    from mlx_h2o.evaluation.runner import parse_specs

    spec = parse_specs(["h2o:score=ema,split=balanced"], [128])[0]
    assert spec.options == {"max_kv_size": 128, "score": "ema", "split": "balanced"}
    cfg = H2OConfig.build(256).budget
    assert (cfg.sink, cfg.heavy, cfg.recent) == (4, 128, 124)
    assert (H2OConfig.build(256, split="balanced").budget.heavy, H2OConfig.build(256, split="recent").budget.heavy) == (64, 32)
