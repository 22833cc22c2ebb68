"""The mlx-h2o command line: generate, eval and passkey on the embedded model, flags reaching every
subcommand, and the passkey prompts it builds."""

import mlx_h2o
import pytest


def test_cli_generate_and_eval_with_h2o(smollm, tmp_path):
    import json
    import subprocess
    import sys

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "mlx_h2o", *args], capture_output=True, text=True)

    r = cli("generate", "--prompt", "Name a colour.", "--system", "Answer briefly.", "--max-tokens", "8", "--cache", "h2o",
            "--max-kv-size", "24", "--h2o-split", "balanced", "--h2o-score", "ema", "--h2o-evict-every", "2", "--h2o-pin-system")
    assert r.returncode == 0, r.stderr
    assert "KV cache (h2o):" in r.stderr
    r = cli("generate", "--prompt", "hi", "--cache", "rotating", "--max-kv-size", "16", "--h2o-score", "ema")
    assert r.returncode == 2 and "--h2o-* options apply to --cache h2o" in r.stderr
    r = cli("generate", "--prompt", "hi", "--cache", "h2o", "--max-kv-size", "16", "--h2o-split", "explicit")
    assert r.returncode == 2 and "needs heavy and recent" in r.stderr
    out = tmp_path / "r.json"
    r = cli("eval", "--cache", "full", "h2o:select=layer", "--max-kv-size", "16", "--seq-len", "40", "--samples", "2",
            "--h2o-score", "cumulative", "--json", str(out), "--quiet")
    assert r.returncode == 0, r.stderr
    assert "| h2o(M=16,score=cumulative,select=layer) | 40 |" in r.stdout
    assert json.loads(out.read_text())["perplexity"][1]["options"] == {"max_kv_size": 16, "score": "cumulative", "select": "layer"}


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
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "mlx_h2o", "passkey", "--cache", "full", "h2o:obs_window=16", "--context", "256",
                        "--depths", "0.5", "--per-depth", "1", "--quiet"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "| full |" in r.stdout and "| h2o(M=64,obs_window=16) |" in r.stdout


@pytest.mark.parametrize("command", ["passkey", "eval", "recall"])
def test_every_model_command_honours_attention(command, monkeypatch):
    """`--attention stock` reaches every subcommand that loads a model (passkey once loaded the model
    itself, so its baselines ran mlx-lm's attention whatever the flag said)."""
    from mlx_h2o import cli

    class Loaded(Exception):
        pass

    def load(*args, **kwargs):
        raise Loaded  # stop once the model would load: the attention switch has been set by then

    chosen = []
    monkeypatch.setattr(mlx_h2o, "use_fast_cpu_attention", lambda on=True: chosen.append(on))
    monkeypatch.setattr(mlx_h2o, "load", load)
    with pytest.raises(Loaded):
        cli.main([command, "--attention", "stock", "--cache", "full", "--quiet"])
    assert chosen == [False]
