"""mlx-lm's own commands with mlx-h2o's policies (the patched wheel, in build/venv-fork, ci/run.sh):
`mlx_lm.generate`, `mlx_lm.cache_prompt` and `mlx_lm.server` on the converted embedded model, offline.

The server test runs `mlx_lm.server --kv-policy h2o` on 127.0.0.1 with a bounded number of requests,
each with a deadline: one request, then 8 concurrent chat completions (half streamed) with prompts of
>= 1,500 tokens; all complete with text, the RSS stays within a stated bound of the first request's,
bad requests get 4xx and the server keeps serving."""

import concurrent.futures
import importlib.util
import os
import subprocess
import sys

import pytest

from mlx_h2o import serving
from mlx_h2o.convert import convert

pytestmark = [
    pytest.mark.patched_mlx_lm,
    pytest.mark.skipif(importlib.util.find_spec("mlx_lm.models.cache_policies") is None,
                       reason="needs the patched mlx-lm wheel (ci/run.sh runs it in build/venv-fork)"),
]

OFFLINE = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
M = 512  # the h2o budget of the server test
PROMPT_TOKENS = 1500
CONCURRENT = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(convert(tmp_path_factory.mktemp("smollm2") / "model"))


def mlx_lm(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "mlx_lm", *args], capture_output=True, text=True, timeout=timeout, env=OFFLINE)


def test_generate_streams_with_h2o(model_dir):
    r = mlx_lm("generate", "--model", model_dir, "--kv-policy", "h2o", "--kv-option", "max_kv_size=64",
               "--prompt", "Write a short poem about the sea.", "--max-tokens", "40")
    assert r.returncode == 0, r.stderr[-2000:]
    text = r.stdout.split("==========")[1].strip()
    assert len(text.split()) >= 5, r.stdout
    assert "Generation: 40 tokens" in r.stdout or "Generation:" in r.stdout


def test_unknown_policy_lists_the_installed_ones(model_dir):
    r = mlx_lm("generate", "--model", model_dir, "--kv-policy", "h2o-typo", "--prompt", "x")
    assert r.returncode == 2
    assert "unknown KV cache policy 'h2o-typo'" in r.stderr
    for name in ("full", "rotating", "h2o", "quantized"):
        assert f"  {name}: " in r.stderr, r.stderr


def test_cache_prompt_then_generate_with_h2o(model_dir, tmp_path):
    cache_file = str(tmp_path / "prompt.safetensors")
    context = "My name is Ada and I keep bees in the hills above Lyon. " * 8
    r = mlx_lm("cache_prompt", "--model", model_dir, "--kv-policy", "h2o", "--kv-option", "max_kv_size=96",
               "--prompt", context, "--prompt-cache-file", cache_file)
    assert r.returncode == 0, r.stderr[-2000:]
    r = mlx_lm("generate", "--prompt-cache-file", cache_file, "--prompt", "Where do I keep bees?", "--max-tokens", "24")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split("==========")[1].strip()


# Deadline of one request of the concurrent round: served one at a time, the last one waits for all
# the others (on a loaded 2-core machine ~90 s each).
ROUND_TIMEOUT = 1800


def _round(port, prompts, max_tokens):
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(serving.chat, port, [{"role": "user", "content": p}], max_tokens, i % 2 == 0, ROUND_TIMEOUT)
                   for i, p in enumerate(prompts)]
        return [f.result(timeout=ROUND_TIMEOUT + 60) for f in futures]


def _h2o_request_cache_mib(model_dir, prefill_step):
    """The most one request's h2o caches can hold, as the server keeps them: K and V rows (float32)
    plus the score and position per row and kv head, for M + one prefill chunk rows per layer."""
    import json

    c = json.load(open(os.path.join(model_dir, "config.json")))
    rows = M + prefill_step
    per_row = c["num_hidden_layers"] * c["num_key_value_heads"] * (2 * c["head_dim"] * 4 + 8)
    return rows * per_row / 2**20


def test_server_h2o_bounded_memory(model_dir, smollm, tmp_path):
    from mlx_lm.generate import cache_batching_blocker
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = smollm
    # The server batches h2o requests when the h2o cache merges; otherwise it serves them one at a time.
    blocker = cache_batching_blocker(make_prompt_cache(model, M, policy="h2o"))
    prompts = [serving.long_prompt(tokenizer, PROMPT_TOKENS, seed=i) for i in range(1 + CONCURRENT)]
    for p in prompts:
        assert len(tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)) >= PROMPT_TOKENS
    lru_entries, prefill_step, prefill_batch = 2, 512, 2
    args = ["--kv-policy", "h2o", "--kv-option", f"max_kv_size={M}", "--prefill-step-size", str(prefill_step),
            "--prompt-cache-size", str(lru_entries), "--prompt-concurrency", str(prefill_batch), "--max-tokens", "64"]
    with serving.serve(model_dir, args, log_path=str(tmp_path / "server.log")) as server:
        first = serving.chat(server.port, [{"role": "user", "content": prompts[0]}], 8, False, 600)
        assert first.status == 200 and first.text.strip(), first
        rss_first = server.rss_mib()
        results = _round(server.port, prompts[1:], 8)
        rss = [rss_first, server.rss_mib()]
        assert all(c.status == 200 and c.text.strip() for c in results), [(c.status, c.error) for c in results]
        assert all(c.ttft is not None for c in results[::2])  # the streamed half
        # Bound: the first request's RSS (one prefill's activations included) plus the caches that may
        # be alive at once (the prompt-cache LRU's entries, and the batch's sequences when batched; each
        # at most M + one chunk rows), plus half the first RSS for the other sequence of a batched
        # prefill chunk (--prompt-concurrency 2) and the allocator's pool. It does not grow with the
        # number of requests served.
        alive = lru_entries + (CONCURRENT if blocker is None else 1)
        bound = rss_first + alive * _h2o_request_cache_mib(model_dir, prefill_step) + 0.5 * rss_first
        assert rss[-1] <= bound, (rss, bound)

        # Bad requests: a clear 4xx, and the server keeps serving.
        status, body = serving.request(server.port, "POST", "/v1/chat/completions", raw=b'{"messages": [')
        assert status == 400 and "Invalid JSON" in str(body)
        bad = serving.chat(server.port, [{"role": "user", "content": "hi"}], 8, False, 120, kv_options={"bogus": 1})
        assert bad.status == 400 and "bogus" in bad.error and "max_kv_size" in bad.error, bad
        bad = serving.chat(server.port, [{"role": "user", "content": "hi"}], 8, False, 120, kv_options=[1])
        assert bad.status == 400 and "kv_options" in bad.error, bad
        ok = serving.chat(server.port, [{"role": "user", "content": "Say hello."}], 16, False, 120, kv_options={"max_kv_size": 128})
        assert ok.status == 200 and ok.text.strip(), ok
        ok = serving.chat(server.port, [{"role": "user", "content": "Say hello."}], 16, True, 120)
        assert ok.status == 200 and ok.text.strip(), ok
        log = server.log()
    if blocker is None:  # batched: nothing served one at a time
        assert "one at a time" not in log, log[-3000:]
    else:  # served one at a time, and the log says why
        assert f"Serving requests one at a time: {blocker}" in log, log[-3000:]
    print(f"\nh2o batched: {blocker is None}; RSS MiB: after the first request {rss_first:.0f}, "
          f"after {CONCURRENT} more {rss[1]:.0f}, bound {bound:.0f}")


def test_server_rejects_a_bad_policy_or_option_at_startup(model_dir):
    r = mlx_lm("server", "--model", model_dir, "--kv-policy", "nope", "--host", serving.HOST, timeout=120)
    assert r.returncode == 2 and "installed policies" in r.stderr and "h2o" in r.stderr
    r = mlx_lm("server", "--model", model_dir, "--kv-policy", "rotating", "--kv-option", "bogus=1", "--host", serving.HOST,
               timeout=120)
    assert r.returncode == 2 and "unknown option 'bogus'" in r.stderr and "keep (int, default 4)" in r.stderr
