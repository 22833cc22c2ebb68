"""The decode loops the tests share: random prompts, a prefill followed by one token at a time
(the logits of every call), greedy continuation from a cache, two caches run in lockstep, and a
saved cache loaded and continued in a new Python process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from tiny_models import CONFIGS

VOCAB = CONFIGS["llama"]["vocab_size"]


def tokens(n, seed=0, batch=None, vocab=VOCAB):
    """Random token ids: shape (n,), or (batch, n)."""
    shape = (n,) if batch is None else (batch, n)
    return mx.array(np.random.default_rng(seed).integers(0, vocab, shape))


def step_logits(model, x, cache, prefill=8, every_position=False):
    """Logits of a prefill of x[:, :prefill], then of each following token of x fed alone. The
    last position's of each call, (B, 1 + T - prefill, V); every_position: all of them, (B, T, V)."""
    out = [model(x[:, :prefill], cache=cache)]
    mx.eval(out[-1])
    for i in range(prefill, x.shape[1]):
        out.append(model(x[:, i : i + 1], cache=cache))
        mx.eval(out[-1])
    if not every_position:
        out = [o[:, -1:] for o in out]
    return np.array(mx.concatenate(out, axis=1).astype(mx.float32))


def prefill(model, cache, prompt):
    """Feed `prompt` (a list of token ids) in one call; the greedy next token."""
    return int(mx.argmax(model(mx.array([prompt]), cache=cache)[0, -1]).item())


def greedy(model, cache, token, steps):
    """`steps` greedy steps from a cache, feeding `token` first: the tokens chosen and each step's
    logits, (steps, V)."""
    y, chosen, logits = int(token), [], []
    for _ in range(steps):
        out = model(mx.array([[y]]), cache=cache)[0, -1]
        y = int(mx.argmax(out).item())
        chosen.append(y)
        logits.append(np.array(out.astype(mx.float32)))
    return chosen, np.stack(logits)


def lockstep(model, x, cache, twin, prefill=8, chunk_at=()):
    """Run `cache` and its `twin` side by side over x (a prefill, then one token a call, or 6 at a
    position in chunk_at); the largest |logit difference| seen."""
    worst, i = 0.0, prefill
    a, b = model(x[:, :prefill], cache=cache), model(x[:, :prefill], cache=twin)
    while i < x.shape[1]:
        worst = max(worst, float(mx.abs(a[:, -1] - b[:, -1]).max()))
        n = 6 if i in chunk_at else 1
        a = model(x[:, i : i + n], cache=cache)
        mx.eval(a)
        b = model(x[:, i : i + n], cache=twin)
        worst = max(worst, float(mx.abs(a - b).max()))
        i += n
    return worst


# A new process: nothing of mlx-h2o has run but the import and its registry of policies (which
# registers the cache classes with mlx-lm), so the attention hook is off until a loaded cache turns it on.
NEW_PROCESS = """
import json, sys
sys.path.insert(0, sys.argv[2])
from mlx_h2o._blas import use_openblas
use_openblas()  # as conftest.py does for the parent: the same GEMMs on both sides
import mlx_h2o
import numpy as np
from mlx_h2o import hook
from mlx_lm.models.cache import load_prompt_cache
from decoding import greedy
from tiny_models import tiny_model
assert mlx_h2o.POLICIES
assert hook._target.__code__ is hook._original_code, "importing mlx_h2o must not swap mlx-lm's attention"
task = json.loads(open(sys.argv[1]).read())
model = tiny_model(task["arch"], **task["model"])
for job in task["jobs"]:
    cache = load_prompt_cache(job["path"])
    job["tokens"], logits = greedy(model, cache, job["last"], task["steps"])
    np.save(job["path"] + ".logits.npy", logits)
    job["classes"] = [type(c).__name__ for c in cache]
print(json.dumps(task["jobs"]))
"""


def continue_in_new_process(jobs, steps, tmp, arch="llama", **model):
    """Load each job's saved cache (job["path"]) in ONE new Python process and continue it `steps`
    greedy tokens from job["last"] on tiny_model(arch, **model). Returns the jobs with "tokens",
    "logits" and "classes" (the loaded caches' types) added."""
    manifest = Path(tmp) / "jobs.json"
    manifest.write_text(json.dumps({"arch": arch, "model": model, "steps": steps, "jobs": jobs}))
    r = subprocess.run([sys.executable, "-c", NEW_PROCESS, str(manifest), str(Path(__file__).parent)],
                       capture_output=True, text=True, env=dict(os.environ), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    done = json.loads(r.stdout.strip().splitlines()[-1])
    for job in done:
        job["logits"] = np.load(job["path"] + ".logits.npy")
    return done
