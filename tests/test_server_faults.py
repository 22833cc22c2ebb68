"""A bounded load-and-fault test of the patched `mlx_lm.server` (mlx-lm patches 0006-0008: admission
and limits, 400s for bad bodies, prompt processing interleaved with decoding, clients that leave,
--kv-budget-bytes), on the converted embedded model, offline, on 127.0.0.1.

One server (`--kv-policy h2o --kv-option max_kv_size=256 --max-tokens-ceiling 48 --kv-budget-bytes
80MB`) gets a bounded set of requests, each with a deadline taken from one overall budget:
concurrent good chat completions, malformed bodies (each a 400 with a readable message), a prompt
over the model's context (a 400 before any prefill, back in well under a second), a foreign
kv_policy, a request whose KV cache could never fit in the budget, a long prompt with short requests
beside it (they finish while it is still being processed), clients that disconnect mid-stream and
before a non-streamed answer. Then: every good request got 200 with text, the server still answers,
its log holds no traceback, and its RSS did not grow by more than a generous bound across the bad
requests. The server is stopped in every case (`serving.serve`: SIGTERM, then SIGKILL)."""

import concurrent.futures
import importlib.util
import json
import os
import socket
import time

import pytest

from mlx_h2o import serving
from mlx_h2o.convert import convert


def _patched_server() -> bool:
    """The installed mlx_lm.server carries patch 0006 (read from its source: nothing imported)."""
    try:
        spec = importlib.util.find_spec("mlx_lm.server")
    except ModuleNotFoundError:
        return False
    if spec is None or not spec.origin:
        return False
    with open(spec.origin, encoding="utf-8") as f:
        return "--max-prompt-tokens" in f.read()


pytestmark = [
    pytest.mark.patched_mlx_lm,
    pytest.mark.skipif(not _patched_server(),
                       reason="needs the patched mlx-lm wheel with patch 0006 (--max-prompt-tokens; "
                              "ci/run.sh runs it in build/venv-fork)"),
]

BUDGET_S = 170.0  # the whole test, server start included (the convert is a module fixture)
M = 256
CEILING = 48  # --max-tokens-ceiling
RSS_GROWTH_MIB = 150  # generous: the bad requests allocate nothing that outlives them
KV_BUDGET = "80MB"  # 4 short h2o requests (12 MB each here) and the long one (24 MB) fit
LONG_PROMPT = 3000  # tokens: ~10 s of prompt processing on 2 cores


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(convert(tmp_path_factory.mktemp("smollm2") / "model"))


class Deadline:
    def __init__(self, seconds):
        self.end = time.monotonic() + seconds

    def left(self, most=60.0):
        left = self.end - time.monotonic()
        assert left > 1, "the fault test ran past its overall budget"
        return min(most, left)


def _post(port, path, body=None, raw=None, timeout=30.0):
    tic = time.perf_counter()
    status, reply = serving.request(port, "POST", path, body=body, raw=raw, timeout=timeout)
    return status, reply, time.perf_counter() - tic


def _error(reply) -> str:
    return reply.get("error", "") if isinstance(reply, dict) else str(reply)


def _raw_chat(port, timeout, **fields):
    """A socket that has sent a chat completion (counting slowly), for a client that then leaves."""
    body = json.dumps({"messages": [{"role": "user", "content": "Count slowly from one to one hundred."}],
                       "max_tokens": CEILING, "temperature": 0.0, **fields}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {serving.HOST}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    sock = socket.create_connection((serving.HOST, port), timeout=timeout)
    sock.sendall(head + body)
    return sock


def _stream_then_disconnect(port, timeout):
    """A streamed chat completion whose client closes the socket after the first content chunk."""
    with _raw_chat(port, timeout, stream=True) as sock:
        stream = sock.makefile("rb")
        status_line = stream.readline()
        while True:
            line = stream.readline()
            if not line or line.startswith(b"data:"):
                break
        stream.close()
    return status_line, line


def _post_then_disconnect(port, timeout):
    """A non-streamed chat completion whose client closes the socket before the answer."""
    # No end-of-text tokens (ids 0 and 2): the answer runs to max_tokens, well after the client left.
    with _raw_chat(port, timeout, logit_bias={"0": -1000, "2": -1000}):
        time.sleep(0.3)


def test_server_survives_bad_and_abusive_requests(model_dir, tmp_path):
    deadline = Deadline(BUDGET_S)
    with open(os.path.join(model_dir, "config.json")) as f:
        context = json.load(f)["max_position_embeddings"]
    args = ["--kv-policy", "h2o", "--kv-option", f"max_kv_size={M}", "--max-tokens-ceiling", str(CEILING),
            "--prompt-cache-size", "2", "--max-tokens", "16", "--kv-budget-bytes", KV_BUDGET]
    log_path = str(tmp_path / "server.log")
    with serving.serve(model_dir, args, log_path=log_path, startup_timeout=deadline.left(90)) as server:
        port = server.port
        hello = [{"role": "user", "content": "Say hello in five words."}]

        # Good requests: one, then three at once (one streamed).
        first = serving.chat(port, hello, 8, False, deadline.left())
        assert first.status == 200 and first.text.strip(), first
        prompts = ["Name a colour.", "Name a fruit.", "Name a country."]
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            futures = [pool.submit(serving.chat, port, [{"role": "user", "content": p}], 8, i == 0, deadline.left())
                       for i, p in enumerate(prompts)]
            good = [f.result(timeout=deadline.left() + 5) for f in futures]
        assert all(c.status == 200 and c.text.strip() for c in good), [(c.status, c.error) for c in good]
        rss_before = server.rss_mib()

        # Bad requests: each a 400 with a message a user can read.
        chat = "/v1/chat/completions"
        over_long = " ".join(["hello"] * (2 * context))
        bad = [
            (chat, None, b'{"messages": [', "Invalid JSON"),
            (chat, [1, 2], None, "Request should be a JSON dictionary"),
            (chat, {"messages": "hello"}, None, "messages must be a non-empty list"),
            (chat, {"messages": []}, None, "messages must be a non-empty list"),
            (chat, {"messages": [42]}, None, "messages[0] must be an object"),
            (chat, {"messages": [{"content": "hi"}]}, None, "messages[0].role must be a string"),
            (chat, {"messages": [{"role": "robot", "content": "hi"}]}, None, "messages[0].role 'robot' is not one of"),
            (chat, {"messages": [{"role": "user", "content": 3}]}, None, "messages[0].content must be a string"),
            (chat, {"messages": hello, "max_tokens": 0}, None, "max_tokens must be a positive integer, got 0"),
            (chat, {"messages": hello, "max_tokens": -5}, None, "max_tokens must be a positive integer"),
            (chat, {"messages": hello, "max_tokens": "10"}, None, "max_tokens must be a positive integer"),
            (chat, {"messages": hello, "max_completion_tokens": 2.5}, None, "max_completion_tokens must be a positive"),
            ("/v1/completions", {"prompt": 42}, None, "prompt must be a string"),
            (chat, {"messages": hello, "kv_policy": "full"}, None, "--kv-policy"),
            (chat, {"messages": hello, "kv_options": {"bogus": 1}}, None, "unknown option(s) bogus"),
            (chat, {"messages": [{"role": "user", "content": over_long}]}, None,
             f"tokens; this server accepts at most {context} (the model's context)"),
            (chat, {"messages": [{"role": "user", "content": " ".join(["word"] * 1800)}], "max_tokens": 40,
                    "kv_options": {"max_kv_size": 2048}}, None, "--kv-budget-bytes is 80000000"),
        ]
        seconds = {}
        for path, body, raw, fragment in bad:
            status, reply, took = _post(port, path, body=body, raw=raw, timeout=deadline.left())
            seconds[fragment] = took
            assert status == 400, (body if raw is None else raw, status, reply)
            assert fragment in _error(reply), (fragment, reply)
            assert "Traceback" not in _error(reply) and "object has no attribute" not in _error(reply), reply
        over_long_s = seconds[bad[-2][3]]
        assert over_long_s < 1.0, f"the over-long prompt took {over_long_s:.2f} s to be refused"
        rss_after = server.rss_mib()
        assert rss_after <= rss_before + RSS_GROWTH_MIB, (rss_before, rss_after)

        # Capped, not refused: a huge max_tokens stops at the ceiling; the server's own policy is fine.
        huge = {"messages": hello, "max_tokens": 10**9, "temperature": 0.0}
        capped = _post(port, chat, huge, timeout=deadline.left())
        assert capped[0] == 200 and capped[1]["usage"]["completion_tokens"] <= CEILING, capped
        own = serving.chat(port, hello, 8, False, deadline.left(), kv_policy="h2o")
        assert own.status == 200 and own.text.strip(), own

        # A client that disconnects mid-stream: the server stops generating for it and says so.
        status_line, first_chunk = _stream_then_disconnect(port, deadline.left())
        assert b" 200 " in status_line and first_chunk.startswith(b"data:"), (status_line, first_chunk)
        while "Client disconnected" not in server.log():
            deadline.left()
            time.sleep(0.1)

        # A non-streaming client that leaves: the server notices without writing to it.
        _post_then_disconnect(port, deadline.left())
        while server.log().count("Client disconnected") < 2:
            deadline.left()
            time.sleep(0.1)

        # A long prompt does not stop the short requests beside it: they finish while it is
        # still being processed (prompt steps of 128 tokens, a quarter of the time while others decode).
        from mlx_lm.utils import load_tokenizer

        long_text = serving.long_prompt(load_tokenizer(model_dir), LONG_PROMPT)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            long = pool.submit(serving.chat, port, [{"role": "user", "content": long_text}], 4, True, deadline.left())
            time.sleep(0.5)
            short = [pool.submit(serving.chat, port, [{"role": "user", "content": p}], 8, True, deadline.left())
                     for p in prompts]
            short = [f.result(timeout=deadline.left() + 5) for f in short]
            long = long.result(timeout=deadline.left() + 5)
        assert long.status == 200 and long.text.strip(), long
        assert all(c.status == 200 and c.text.strip() for c in short), [(c.status, c.error) for c in short]
        short_s = max(c.seconds for c in short)
        assert short_s < long.ttft / 2, (f"short requests took up to {short_s:.1f} s beside a long prompt "
                                         f"answered after {long.ttft:.1f} s")

        # Still serving: health, models (offline: no hub cache, no traceback), a chat completion.
        status, reply = serving.request(port, "GET", "/health", timeout=deadline.left())
        assert status == 200 and reply == {"status": "ok"}, reply
        status, reply = serving.request(port, "GET", "/v1/models", timeout=deadline.left())
        assert status == 200 and os.path.realpath(model_dir) in [m["id"] for m in reply["data"]], reply
        last = serving.chat(port, hello, 8, True, deadline.left())
        assert last.status == 200 and last.text.strip(), last
        log = server.log()
    assert "Traceback" not in log, log[-4000:]
    print(f"\nfault test: {len(bad)} bad requests answered 400; the over-long prompt ({2 * context} words) in "
          f"{over_long_s * 1000:.0f} ms; RSS {rss_before:.0f} -> {rss_after:.0f} MiB; short requests beside a "
          f"{LONG_PROMPT}-token prompt in {short_s:.1f} s, its TTFT {long.ttft:.1f} s; "
          f"{BUDGET_S - (deadline.end - time.monotonic()):.0f} s in all")
