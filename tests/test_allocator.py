"""use_mmap_for_large_buffers: freed large buffers go back to the system (glibc), opt-in only."""

import subprocess
import sys

import pytest

import mlx_h2o

# 20 buffers of 2 MiB written, then a small one allocated after them (it pins the heap's top, so the
# heap cannot shrink past it), then the 20 freed: their pages leave the process only if each was a
# mapping of its own. A 4 MiB buffer freed first raises glibc's own threshold past 2 MiB, as a
# growing KV cache does.
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
libc.free(libc.malloc(4 << 20))
before = rss_mib()
blocks = [libc.malloc(2 << 20) for _ in range(20)]
for b in blocks:
    ctypes.memset(b, 1, 2 << 20)
pin = libc.malloc(64 << 10)
held = rss_mib() - before
for b in blocks:
    libc.free(b)
print(held, rss_mib() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_freed_large_buffers_leave_the_process():
    def run(mode):
        out = subprocess.run([sys.executable, "-c", _FREED_PAGES, mode], capture_output=True, text=True, check=True)
        return [float(x) for x in out.stdout.split()]

    held, kept = run("on")
    assert held >= 38 and kept < 4, (held, kept)
    held, kept = run("off")  # glibc's own threshold: the freed buffers stay in the heap
    assert held >= 38 and kept >= 38, (held, kept)


def test_mmap_threshold_rejects_bad_values():
    for bad in (0, 1024, 64 << 20, 2.5, True, "128k"):
        with pytest.raises(ValueError, match="threshold must be an integer"):
            mlx_h2o.use_mmap_for_large_buffers(bad)
