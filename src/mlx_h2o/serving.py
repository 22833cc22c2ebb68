"""Run and drive `mlx_lm.server` on 127.0.0.1 for the server test and benchmark: start it with a KV
cache policy, send chat completions (streaming or not) with a bounded timeout, read the process's RSS.

Only the loopback address is ever used; every call has a deadline and `serve()` always stops the
process it started.
"""

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@dataclass
class Server:
    process: subprocess.Popen
    port: int
    log_path: str

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def rss_mib(self) -> float:
        """Resident memory of the server process (Linux /proc, else ps)."""
        try:
            with open(f"/proc/{self.process.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) / 1024
        except FileNotFoundError:
            pass
        out = subprocess.run(["ps", "-o", "rss=", "-p", str(self.process.pid)], capture_output=True, text=True, check=True)
        return int(out.stdout.strip()) / 1024


@contextlib.contextmanager
def serve(model_dir: str, extra_args: Sequence[str] = (), log_path: Optional[str] = None, startup_timeout: float = 180.0,
          python: str = sys.executable) -> Iterator[Server]:
    """`mlx_lm.server --model MODEL_DIR --host 127.0.0.1 --port P *extra_args` (through
    `python -m mlx_h2o.run_mlx_lm`: OpenBLAS matmuls), answering /health; stopped on exit."""
    port = free_port()
    log_path = log_path or os.path.join(os.environ.get("TMPDIR", "/tmp"), f"mlx_lm_server_{port}.log")
    cmd = [python, "-m", "mlx_h2o.run_mlx_lm", "server", "--model", str(model_dir), "--host", HOST, "--port", str(port), *extra_args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with open(log_path, "w") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = Server(process, port, log_path)
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"mlx_lm.server exited with {process.returncode}:\n{server.log()[-3000:]}")
            try:
                status, _ = request(port, "GET", "/health", timeout=5)
                if status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"mlx_lm.server did not start in {startup_timeout:.0f} s:\n{server.log()[-3000:]}")
            time.sleep(0.5)
        yield server
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=20)


def request(port: int, method: str, path: str, body=None, timeout: float = 300.0, raw: Optional[bytes] = None):
    """(status, parsed JSON or text) of one request to the local server."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        headers = {"Content-Type": "application/json"} if data is not None else {}
        conn.request(method, path, body=data, headers=headers)
        response = conn.getresponse()
        text = response.read().decode("utf-8", errors="replace")
        try:
            return response.status, json.loads(text)
        except json.JSONDecodeError:
            return response.status, text
    finally:
        conn.close()


@dataclass
class Completion:
    status: int
    text: str
    seconds: float  # request sent -> last byte
    ttft: Optional[float]  # request sent -> first content (streaming only)
    error: Optional[str] = None
    usage: Optional[dict] = None  # the server's token counts (cached_tokens: the prompt cache's share)


def chat(port: int, messages: List[dict], max_tokens: int, stream: bool, timeout: float = 300.0, **fields) -> Completion:
    """One chat completion; a streamed one is read as server-sent events until [DONE]."""
    body = {"messages": messages, "max_tokens": max_tokens, "stream": stream, "temperature": 0.0, **fields}
    if stream:
        body.setdefault("stream_options", {"include_usage": True})
    tic = time.perf_counter()
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200 or not stream:
            payload = response.read().decode("utf-8", errors="replace")
            seconds = time.perf_counter() - tic
            try:
                payload = json.loads(payload)
            except json.JSONDecodeError:
                return Completion(response.status, "", seconds, None, payload)
            if response.status != 200:
                return Completion(response.status, "", seconds, None, str(payload.get("error", payload)))
            return Completion(200, payload["choices"][0]["message"]["content"] or "", seconds, None,
                              usage=payload.get("usage"))
        parts, ttft, usage = [], None, None
        for line in response:
            line = line.decode("utf-8", errors="replace").strip()
            if not line.startswith("data:"):
                continue  # keepalive comments
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            usage = chunk.get("usage") or usage
            if not chunk.get("choices"):
                continue  # the usage chunk
            delta = chunk["choices"][0].get("delta", {}).get("content") or ""
            if delta and ttft is None:
                ttft = time.perf_counter() - tic
            parts.append(delta)
        return Completion(200, "".join(parts), time.perf_counter() - tic, ttft, usage=usage)
    finally:
        conn.close()


def long_prompt(tokenizer, min_tokens: int, seed: int = 0, path: str = "/usr/share/common-licenses/Apache-2.0") -> str:
    """A user message of at least `min_tokens` tokens: real text from `path`, rotated by `seed` so
    that concurrent requests do not share a prefix, and a question about it at the end."""
    with open(path, encoding="utf-8") as f:
        words = f.read().split()
    start = (seed * 997) % len(words)
    words = words[start:] + words[:start]
    count = max(1, min_tokens // 2)
    while len(tokenizer.encode(" ".join((words * (1 + count // len(words)))[:count]))) < min_tokens:
        count = int(count * 1.1) + 1
    text = " ".join((words * (1 + count // len(words)))[:count])
    return text + "\n\nIn one sentence: what is this text about?"
