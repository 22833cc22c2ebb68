"""use_mmap_for_large_buffers: freed large buffers go back to the system (glibc); limit_mlx_buffer_cache:
MLX keeps few freed ones. Importing mlx_h2o leaves both allocators alone; the commands that own their
process opt in, MLX_H2O_ALLOCATOR=glibc out."""

import os
import subprocess
import sys

import pytest

import mlx_h2o

# 20 buffers of 2 MiB written, then a 3 MiB one allocated after them (it pins the heap's top, so the
# heap cannot shrink past it: a small one could land in a hole the imports left lower in the heap,
# and then the top would shrink on its own), then the 20 freed: their pages leave the process only if
# each was a mapping of its own. A 4 MiB buffer freed first raises glibc's own threshold past 3 MiB,
# as a growing KV cache does.
_FREED_PAGES = """
import ctypes, os, sys
import mlx_h2o
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
if sys.argv[1] == "on":
    assert mlx_h2o.use_mmap_for_large_buffers() is True
elif sys.argv[1] == "env-off":
    assert mlx_h2o.use_mmap_for_large_buffers() is False  # MLX_H2O_ALLOCATOR=glibc
libc.free(libc.malloc(4 << 20))
before = rss_mib()
blocks = [libc.malloc(2 << 20) for _ in range(20)]
for b in blocks:
    ctypes.memset(b, 1, 2 << 20)
pin = libc.malloc(3 << 20)
held = rss_mib() - before
for b in blocks:
    libc.free(b)
print(held, rss_mib() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_freed_large_buffers_leave_the_process():
    def run(mode, **env):
        out = subprocess.run([sys.executable, "-c", _FREED_PAGES, mode], capture_output=True, text=True, check=True,
                             env={**os.environ, **env})
        return [float(x) for x in out.stdout.split()]

    held, kept = run("on")
    assert held >= 38 and kept < 4, (held, kept)
    held, kept = run("off")  # glibc's own threshold: the freed buffers stay in the heap
    assert held >= 38 and kept >= 38, (held, kept)
    held, kept = run("env-off", MLX_H2O_ALLOCATOR="glibc")  # the opt-out: the call leaves glibc's threshold
    assert held >= 38 and kept >= 38, (held, kept)


# What a command's process and an importing one get: (mmap threshold, MLX's cache limit, the report's words).
_COMMAND_PROCESS = """
import sys
import mlx_h2o
from mlx_h2o import _allocator
if sys.argv[1] == "command":
    from mlx_h2o.cli import main
    main(["options"])  # any subcommand: the process setup comes first
elif sys.argv[1] == "run_mlx_lm":
    import mlx_h2o.run_mlx_lm as r, runpy
    runpy.run_module = lambda *a, **k: None  # the setup only, not mlx-lm's command
    r.main()
import mlx.core as mx  # (after the command's setup, which opts in to OpenBLAS before MLX loads)
limit = mx.set_cache_limit(0)  # (returns the limit in force)
print(_allocator.mmap_threshold(), "|", limit, "|", _allocator.allocator_description())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
@pytest.mark.parametrize("entry", ["command", "run_mlx_lm"])
def test_commands_opt_their_process_in_and_the_environment_opts_out(entry):
    def run(what, **env):
        out = subprocess.run([sys.executable, "-c", _COMMAND_PROCESS, what], capture_output=True, text=True,
                             check=True, env={**os.environ, **env})
        return out.stdout.strip().splitlines()[-1]

    mlx_default = 32 << 20  # MLX's own cache limit on the CPU
    assert run("import") == f"None | {mlx_default} | the C allocator's own"
    assert run(entry) == "131072 | 1048576 | own maps above 128 KiB (freed to the system); MLX keeps 1 MiB of freed ones"
    assert run(entry, MLX_H2O_ALLOCATOR="glibc") == f"None | {mlx_default} | the C allocator's own (MLX_H2O_ALLOCATOR=glibc)"


def test_mmap_threshold_rejects_bad_values():
    for bad in (0, 1024, 64 << 20, 2.5, True, "128k"):
        with pytest.raises(ValueError, match="threshold must be an integer"):
            mlx_h2o.use_mmap_for_large_buffers(bad)


def test_mlx_buffer_cache_limit_rejects_bad_values():
    for bad in (-1, 2.5, True, "1M", None):
        with pytest.raises(ValueError, match="limit must be a number of bytes"):
            mlx_h2o.limit_mlx_buffer_cache(bad)


# A prefill's pattern: buffers of several sizes freed, then others asked for. MLX reuses a cached
# buffer only for a request of about its size, so under its own limit the freed ones stay its memory.
_CACHED_BUFFERS = """
import sys
import mlx_h2o
import mlx.core as mx
if sys.argv[1] == "limited":
    assert mlx_h2o.limit_mlx_buffer_cache() is True
for mib in (1, 2, 3, 4, 5):
    mx.eval(mx.full((mib << 18,), 1.0))  # freed once evaluated and dropped
print(mx.get_cache_memory())
"""


def test_limited_mlx_buffer_cache_keeps_no_more_than_its_limit():
    def run(mode):
        out = subprocess.run([sys.executable, "-c", _CACHED_BUFFERS, mode], capture_output=True, text=True, check=True)
        return int(out.stdout.split()[-1])

    assert run("default") >= 10 << 20  # the five buffers, 15 MiB, all kept
    assert run("limited") <= 1 << 20


_CHILD_PEAK = """
import sys
sys.path.insert(0, sys.argv[1])
from mlx_h2o.evaluation.memory import _peak_rss_bytes
from bench_peer import peak_rss_mib
print(_peak_rss_bytes() / 2**20, peak_rss_mib())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status")
def test_a_child_reports_its_own_peak_not_its_parents():
    # getrusage's ru_maxrss in a child holds the peak of the process that exec'd it: bench_peer's
    # workers (started by a parent that loaded the model) all reported at least the parent's peak.
    import pathlib

    ballast = bytearray(600 << 20)
    ballast[::4096] = b"\x01" * len(ballast[::4096])  # resident in this process
    bench = str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks")
    out = subprocess.run([sys.executable, "-c", _CHILD_PEAK, bench], capture_output=True, text=True, check=True)
    del ballast
    ours, bench_peer = (float(x) for x in out.stdout.split())
    assert 10 < ours < 400 and 10 < bench_peer < 400, (ours, bench_peer)  # MLX's import, not the 600 MiB
