"""Memory accounting: MLX's allocator counters, process RSS, and the bytes a cache holds."""

import ctypes
import os
import resource
import sys
from typing import Optional

import mlx.core as mx
import numpy as np


def _current_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: fall back to the peak
        return _peak_rss_bytes()


def _peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def kv_bytes(cache) -> int:
    """Bytes the per-layer caches hold (each cache's `nbytes`, as mlx-lm defines it)."""
    return int(sum(c.nbytes for c in cache))


def memory_snapshot() -> dict:
    return {
        "mlx_active_bytes": mx.get_active_memory(),
        "mlx_peak_bytes": mx.get_peak_memory(),
        "rss_bytes": _current_rss_bytes(),
        "rss_peak_bytes": _peak_rss_bytes(),
    }


def resident_bytes(a: mx.array) -> Optional[int]:
    """Bytes of `a`'s memory that are in RAM (committed pages, counted with mincore), for
    measuring one buffer exactly whatever else the process holds. None where mincore is not
    available (not Linux). `a` is evaluated; it must be contiguous (a dtype NumPy can view)."""
    if not sys.platform.startswith("linux"):
        return None
    page = os.sysconf("SC_PAGE_SIZE")
    view = memoryview(a)  # no copy for a contiguous array
    start = np.frombuffer(view, dtype=np.uint8).ctypes.data
    del view
    first = start - start % page
    n = (start + a.nbytes - first + page - 1) // page
    vec = (ctypes.c_ubyte * n)()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mincore(ctypes.c_void_p(first), ctypes.c_size_t(n * page), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return int((np.frombuffer(vec, dtype=np.uint8) & 1).sum()) * page
