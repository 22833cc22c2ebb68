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
    """Bytes of the tokens the per-layer caches hold. mlx-lm's KVCache and QuantizedKVCache report
    their whole step-allocated buffers as `nbytes`; for those only the live rows are counted, so
    that compression ratios between policies are measured on what is stored."""
    from mlx.utils import tree_reduce
    from mlx_lm.models import cache as lm_cache

    total = 0
    for c in cache:
        if isinstance(c, (lm_cache.KVCache, lm_cache.QuantizedKVCache)) and not c.empty():
            total += tree_reduce(lambda acc, x: acc + x.nbytes, c.keys_and_values(), 0)
        else:
            total += c.nbytes
    return int(total)


def memory_snapshot() -> dict:
    return {
        "mlx_active_bytes": mx.get_active_memory(),
        "mlx_peak_bytes": mx.get_peak_memory(),
        "rss_bytes": _current_rss_bytes(),
        "rss_peak_bytes": _peak_rss_bytes(),
    }
