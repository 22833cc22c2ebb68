"""Memory accounting: MLX's allocator counters, process RSS, and the bytes a cache holds."""

import os
import resource
import sys

import mlx.core as mx


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
