"""The mlx-h2o command line: generate, eval and passkey on the embedded model, the one spelling of
the cache options (`--kv-policy` / `--kv-option`, as in mlx-lm) on every subcommand, the deprecated
`--cache` / `--h2o-*` spellings, flags reaching every subcommand, and the passkey prompts it builds."""

import json
import subprocess
import sys

import mlx_h2o
import pytest

from mlx_h2o import cli

MODEL_COMMANDS = ["generate", "eval", "passkey", "recall"]
DEPRECATED = "is deprecated and will be removed in the next release"


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "mlx_h2o", *args], capture_output=True, text=True)


def _specs(argv):
    """What a model subcommand would run, without loading a model."""
    specs = cli._command_specs(cli.build_parser().parse_args(argv))
    return specs if isinstance(specs, list) else [specs]


@pytest.fixture
def no_model(monkeypatch):
    """cli.main stops where it would load the model (every error below must come before that)."""

    class Loaded(Exception):
        pass

    def load(*args, **kwargs):
        raise Loaded

    monkeypatch.setattr(mlx_h2o, "load", load)
    return Loaded


def test_cli_generate_and_eval_with_h2o(smollm, tmp_path):
    r = _cli("generate", "--prompt", "Name a colour.", "--system", "Answer briefly.", "--max-tokens", "8", "--kv-policy", "h2o",
             "--max-kv-size", "24", "--kv-option", "split=balanced", "--kv-option", "score=ema", "--kv-option", "evict_every=2",
             "--pin-system")
    assert r.returncode == 0, r.stderr
    assert "KV cache (h2o):" in r.stderr and "deprecated" not in r.stderr
    assert "(float16 rows)" in r.stderr  # the float32 model's rows, halved by default (storage.default_kv_dtype)
    out = tmp_path / "r.json"
    # two variants of one policy side by side; --kv-option reaches both, a variant's own options win
    r = _cli("eval", "--kv-policy", "full", "h2o:select=layer", "h2o:select=layer,score=ema", "--max-kv-size", "16",
             "--seq-len", "40", "--samples", "2", "--kv-option", "score=cumulative", "--json", str(out), "--quiet")
    assert r.returncode == 0, r.stderr
    assert "| h2o(M=16,score=cumulative,select=layer) | 40 |" in r.stdout
    assert "| h2o(M=16,select=layer,score=ema) | 40 |" in r.stdout
    rows = json.loads(out.read_text())["perplexity"]
    assert [r["options"] for r in rows] == [{}, {"max_kv_size": 16, "score": "cumulative", "select": "layer"},
                                            {"max_kv_size": 16, "select": "layer", "score": "ema"}]


def test_cli_deprecated_spelling_still_generates(smollm):
    r = _cli("generate", "--prompt", "Name a colour.", "--system", "Answer briefly.", "--max-tokens", "4", "--cache", "h2o",
             "--max-kv-size", "24", "--h2o-split", "balanced", "--h2o-score", "ema", "--h2o-pin-system")
    assert r.returncode == 0, r.stderr
    assert "KV cache (h2o):" in r.stderr
    for old, new in [("--cache", "--kv-policy"), ("--h2o-split", "--kv-option split="), ("--h2o-score", "--kv-option score="),
                     ("--h2o-pin-system", "--pin-system")]:
        assert f"mlx-h2o: warning: {old} {DEPRECATED}; use {new}" in r.stderr


@pytest.mark.parametrize("argv, labels, options", [
    (["generate", "--prompt", "x", "--kv-policy", "h2o", "--kv-option", "max_kv_size=32", "--kv-option", "score=ema"],
     ["h2o(M=32,score=ema)"], {"max_kv_size": 32, "score": "ema"}),
    (["generate", "--prompt", "x", "--kv-policy", "h2o:score=ema", "--max-kv-size", "32", "--kv-option", "kv-bits=mixed"],
     ["h2o(M=32,kv_bits=4/8,score=ema)"], {"max_kv_size": 32, "kv_bits": "4/8", "score": "ema"}),
    (["generate", "--prompt", "x", "--kv-policy", "reserved", "--max-context", "64"], ["reserved(max_context=64)"], {"max_context": 64}),
    (["generate", "--prompt", "x"], ["full"], {}),
    (["eval", "--kv-policy", "full", "h2o", "--kv-option", "score=ema", "--max-kv-size", "16", "32"],
     ["full", "h2o(M=16,score=ema)", "h2o(M=32,score=ema)"], None),
    (["eval", "--kv-policy", "h2o", "h2o:kv_bits=mixed", "--kv-option", "max_kv_size=64"],
     ["h2o(M=64)", "h2o(M=64,kv_bits=4/8)"], None),
    (["eval"], None, None),  # default full rotating: rotating needs a budget
    (["passkey", "--kv-policy", "full", "h2o", "--kv-option", "obs_window=16", "--context", "256"],
     ["full", "h2o(M=64,obs_window=16)"], None),
    (["passkey", "--context", "256"], ["full", "rotating(M=64)", "h2o(M=64)"], None),
    (["recall", "--kv-policy", "full", "rotating", "h2o", "--kv-option", "chunk=4", "--max-kv-size", "48"],
     ["full", "rotating(M=48)", "h2o(M=48,chunk=4)"], None),
    (["recall"], ["full", "rotating(M=256)", "h2o(M=256)"], None),
])
def test_every_model_command_takes_kv_policy_and_kv_option(argv, labels, options):
    if labels is None:
        with pytest.raises(ValueError, match="policy 'rotating' needs a budget: give --max-kv-size, --kv-option max_kv_size=M"):
            _specs(argv)
        return
    specs = _specs(argv)
    assert [s.label for s in specs] == labels
    if options is not None:
        assert specs[0].options == options


def test_kv_option_applies_to_every_policy_that_has_it():
    specs = _specs(["eval", "--kv-policy", "full", "quantized", "rotated", "--kv-option", "bits=8", "--kv-option", "group_size=64"])
    assert [(s.policy, s.options) for s in specs] == [("full", {}), ("quantized", {"bits": 8, "group_size": 64}),
                                                      ("rotated", {"bits": 8, "group_size": 64})]
    # a policy's own options win: quantized does not take bits=2, but it says bits=4 itself
    specs = _specs(["eval", "--kv-policy", "quantized:bits=4", "rotated", "--kv-option", "bits=2"])
    assert [s.label for s in specs] == ["quantized(bits=4)", "rotated(bits=2)"]
    # a later --kv-option wins over an earlier one of the same key
    assert _specs(["eval", "--kv-policy", "quantized", "--kv-option", "bits=8", "--kv-option", "bits=4"])[0].options == {"bits": 4}


@pytest.mark.parametrize("command", MODEL_COMMANDS)
@pytest.mark.parametrize("policies, options, message", [
    (["rotating"], ["score=ema"], "option 'score' is not an option of any listed policy (rotating: max_kv_size, keep, kv_dtype); "
                                  "`mlx-h2o options NAME` prints a policy's options"),
    (["h2o"], ["bogus=1"], "option 'bogus' is not an option of any listed policy (h2o: max_kv_size, "),
    (["h2o:bogus=1"], [], "unknown option(s) bogus for policy 'h2o'; its options: max_kv_size, "),
    (["h2o"], ["kv_bits=7"], "option kv_bits=7 of policy 'h2o': kv_bits must be one of "),
    (["h2o"], ["sink=-1"], "option sink=-1 of policy 'h2o': sink must be an integer >= 0, got -1"),
    (["full", "rotating"], ["score=ema"], "option 'score' is not an option of any listed policy (full: kv_dtype; "
                                          "rotating: max_kv_size, keep, kv_dtype)"),
    (["quantized", "rotated"], ["bits=2"], "option bits=2 of policy 'quantized': bits must be one of 8, 4, got '2'"),
])
def test_bad_kv_options_exit_2_with_the_message(command, policies, options, message, no_model, capsys):
    argv = [command, "--kv-policy", *policies, *(a for o in options for a in ("--kv-option", o))]
    argv += {"generate": ["--prompt", "x", "--max-kv-size", "16"], "passkey": ["--quiet"]}.get(command, ["--max-kv-size", "16", "--quiet"])
    if command == "generate" and len(policies) > 1:
        message = f"generate runs one policy, got --kv-policy {' '.join(policies)}"
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"mlx-h2o {command}: error: " in err and message in err, err


@pytest.mark.parametrize("argv, message", [
    (["generate", "--prompt", "x", "--kv-policy", "h2o", "--max-kv-size", "8", "--kv-option", "max_kv_size=9"],
     "--max-kv-size 8 and --kv-option max_kv_size=9 disagree"),
    (["generate", "--prompt", "x", "--kv-policy", "rotating", "--max-kv-size", "8", "--system", "s", "--pin-system"],
     "--pin-system pins through the policy's pin option: policy 'rotating' has none (policies with one: h2o)"),
    (["generate", "--prompt", "x", "--kv-policy", "h2o", "--max-kv-size", "8", "--pin-system"], "--pin-system needs --system"),
    (["generate", "--prompt", "x", "--kv-policy", "reserved", "--max-kv-size", "8"], "option 'max_kv_size' is not an option of any listed policy"),
    (["eval", "--kv-policy", "rotating", "--kv-option", "max_kv_size=8", "--max-kv-size", "16"],
     "give the budgets with --max-kv-size or with --kv-option max_kv_size, not both"),
    (["passkey", "--budget", "2"], "--budget must be a fraction in (0, 1]"),
])
def test_inconsistent_cache_flags_exit_2(argv, message, no_model, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"mlx-h2o {argv[0]}: error: {message}" in err, err


@pytest.mark.parametrize("command", MODEL_COMMANDS)
@pytest.mark.parametrize("flags, message", [
    (["--kv-policy", "lru"], "argument --kv-policy: invalid choice: 'lru' (choose from full, h2o, quantized, reserved, rotated, rotating)"),
    (["--kv-policy", "full", "lru:x=1"], "argument --kv-policy: invalid choice: 'lru'"),
    (["--kv-option", "score"], "argument --kv-option: expected KEY=VALUE"),
])
def test_malformed_cache_flags_are_argparse_errors(command, flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([command, *flags])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"mlx-h2o {command}: error: {message}" in err, err


def _deprecated_h2o_flags():
    """(flag, its arguments, the --kv-option it stands for) for every --h2o-* alias."""
    from mlx_h2o.caches.h2o import OPTIONS
    from mlx_h2o.options import Flag

    out = []
    for o in OPTIONS:
        if o.name == "max_kv_size":
            continue
        flag = "--h2o-" + o.name.replace("_", "-")
        if isinstance(o.kind, Flag):
            out.append((flag, [], f"{o.name}=true"))
        elif o.name == "pin":
            out.append((flag, ["0:4", "8:12"], "pin=0:4;8:12"))
        else:
            out.append((flag, ["VALUE"], f"{o.name}=VALUE"))
    return out


@pytest.mark.parametrize("command", MODEL_COMMANDS)
def test_deprecated_h2o_flags_map_onto_kv_option_and_warn(command, capsys):
    flags = _deprecated_h2o_flags()
    assert len(flags) > 20 and ("--h2o-kv-bits", ["VALUE"], "kv_bits=VALUE") in flags
    for flag, values, item in flags:
        args = cli.build_parser().parse_args([command, flag, *values, "--kv-option", "later=1"])
        assert args.kv_option == [item, "later=1"], flag
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"mlx-h2o: warning: {flag} {DEPRECATED}; use --kv-option "), err
        assert not hasattr(args, flag[2:].replace("-", "_")), flag  # no stray destination


@pytest.mark.parametrize("command", MODEL_COMMANDS)
def test_deprecated_cache_maps_onto_kv_policy_and_warns(command, capsys):
    argv = [command, "--cache", "full", "h2o:select=layer", "--h2o-score", "cumulative", "--h2o-rotate"]
    argv += ["--max-kv-size", "16"] if command in ("eval", "recall") else ["--context", "64"] if command == "passkey" else []
    if command == "generate":
        argv[2:4] = ["h2o:select=layer", "--max-kv-size", "16"]  # generate runs one policy
    args = cli.build_parser().parse_args(argv)
    err = capsys.readouterr().err.splitlines()
    assert err == [f"mlx-h2o: warning: --cache {DEPRECATED}; use --kv-policy",
                   f"mlx-h2o: warning: --h2o-score {DEPRECATED}; use --kv-option score=...",
                   f"mlx-h2o: warning: --h2o-rotate {DEPRECATED}; use --kv-option rotate=true"]
    h2o = [s for s in _specs(argv) if s.policy == "h2o"]
    assert [s.label for s in h2o] == ["h2o(M=16,score=cumulative,rotate=True,select=layer)"]
    assert args.kv_policy[-1] == "h2o:select=layer"


def test_deprecated_pin_system(capsys):
    args = cli.build_parser().parse_args(["generate", "--kv-policy", "h2o", "--h2o-pin-system"])
    assert args.pin_system is True
    assert capsys.readouterr().err == f"mlx-h2o: warning: --h2o-pin-system {DEPRECATED}; use --pin-system\n"
    assert cli.build_parser().parse_args(["generate"]).pin_system is False


def test_deprecated_h2o_flag_is_checked_like_kv_option(no_model, capsys):
    assert cli.main(["eval", "--cache", "full", "rotating", "--max-kv-size", "16", "--h2o-score", "ema", "--quiet"]) == 2
    assert "option 'score' is not an option of any listed policy (full: kv_dtype; rotating: max_kv_size, keep, kv_dtype)" in capsys.readouterr().err


@pytest.mark.parametrize("command", MODEL_COMMANDS)
def test_help_lists_policies_and_kv_option_and_no_old_flag(command, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--kv-policy NAME" in out and "--kv-option KEY=VALUE" in out and "printed by `mlx-h2o options NAME`" in out
    assert "--h2o-" not in out and "--cache" not in out
    for name, policy in mlx_h2o.POLICIES.items():
        assert f"  {name} " in out and policy.summary in out
    assert f"default: {' '.join(cli.DEFAULT_POLICIES[command])})" in out


def test_shared_flags_are_declared_once():
    """The flags several subcommands share come from parent parsers: each subcommand's copy is the
    same argparse action, and the cache flags are the same on all four."""
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, cli.argparse._SubParsersAction))
    actions = {c: {s: a for a in sub.choices[c]._actions for s in a.option_strings} for c in MODEL_COMMANDS}
    for flag in ["--model", "--weights", "--attention", "--kv-policy", "--kv-option", "--cache", "--h2o-kv-bits"]:
        assert len({id(actions[c][flag]) for c in MODEL_COMMANDS}) == 1, flag
    for flag in ["--text-files", "--seed", "--json", "--quiet"]:
        assert len({id(actions[c][flag]) for c in ("eval", "passkey", "recall")}) == 1, flag
    for flag in ["--doc-set", "--policy-batch", "--prefill", "--max-kv-size"]:
        assert actions["eval"][flag] is actions["recall"][flag], flag
    assert actions["generate"]["--prefill-step-size"] is actions["passkey"]["--prefill-step-size"]


def test_passkey_prompts_hide_the_key_at_the_asked_depth(smollm):
    from mlx_h2o.evaluation import load_corpus
    from mlx_h2o.evaluation.passkey import QUESTION, passkey_trials

    _, tokenizer = smollm
    trials = passkey_trials(tokenizer, load_corpus(), 512, [0.0, 0.5, 1.0], 2)
    assert len(trials) == 6 and len({t.doc for t in trials}) == 2 and len({t.key for t in trials}) == 6
    for t in trials:
        text = tokenizer.decode(t.prompt)
        assert abs(len(t.prompt) - 512) <= 8 and text.count(t.key) == 2 and QUESTION in text
        where = text.index(t.key) / text.index(QUESTION)
        assert abs(where - t.depth) < 0.1
    with pytest.raises(ValueError, match="depths must lie in"):
        passkey_trials(tokenizer, load_corpus(), 512, [1.5], 1)


def test_cli_passkey_runs(smollm):
    r = _cli("passkey", "--kv-policy", "full", "h2o:obs_window=16", "--context", "256", "--depths", "0.5", "--per-depth", "1", "--quiet")
    assert r.returncode == 0, r.stderr
    assert "| full |" in r.stdout and "| h2o(M=64,obs_window=16) |" in r.stdout


@pytest.mark.parametrize("command", ["passkey", "eval", "recall"])
def test_every_model_command_honours_attention(command, monkeypatch, no_model):
    """`--attention stock` reaches every subcommand that loads a model (passkey once loaded the model
    itself, so its baselines ran mlx-lm's attention whatever the flag said)."""
    chosen = []
    monkeypatch.setattr(mlx_h2o, "use_fast_cpu_attention", lambda on=True: chosen.append(on))
    with pytest.raises(no_model):  # stop once the model would load: the attention switch has been set by then
        cli.main([command, "--attention", "stock", "--kv-policy", "full", "--quiet"])
    assert chosen == [False]


def test_a_command_run_in_process_leaves_the_attention_setting_as_found(no_model):
    """`--attention fused` is the command's choice for its run: a caller of cli.main keeps its own
    (the switch once stayed on, and mlx-lm's quantized cache in later code ran the fused kernel)."""
    from mlx_h2o import hook

    before = hook.fast_cpu_attention_setting()
    with pytest.raises(no_model):
        cli.main(["eval", "--attention", "fused", "--kv-policy", "full", "--quiet"])
    assert hook.fast_cpu_attention_setting() == before and before is not True
