"""Memory accounting: MLX's allocator counters, process RSS, and the bytes a cache holds."""

import ctypes
import os
import resource
import sys
from typing import List, Optional, Tuple

import mlx.core as mx
import numpy as np


def _current_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: fall back to the peak
        return _peak_rss_bytes()


def _peak_rss_bytes() -> int:
    """This process's peak resident memory. On Linux from VmHWM: getrusage's ru_maxrss also holds the
    peak of the process that exec'd it (a worker started by a 300 MiB parent reports at least that)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
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


def array_address(a: mx.array) -> int:
    """Address of `a`'s first element (evaluates `a`; it must be contiguous, a dtype NumPy can view)."""
    view = memoryview(a)  # no copy for a contiguous array
    address = np.frombuffer(view, dtype=np.uint8).ctypes.data
    del view
    return address


def memory_maps() -> List[Tuple[int, int, str, dict]]:
    """This process's memory mappings, from /proc/self/smaps: (start, end, name, fields) each, the name
    the mapped file's path (its first word) or a kernel label such as '[heap]' ('' for anonymous memory), the fields
    the sizes in bytes by name ('Rss', 'AnonHugePages', ...) and 'VmFlags' as a list of flags. Empty
    where there is no /proc/self/smaps (not Linux)."""
    maps = []
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head, *rest = line.split()
                if "-" in head and not head.endswith(":"):
                    start, end = (int(x, 16) for x in head.split("-"))
                    maps.append((start, end, rest[4] if len(rest) > 4 else "", {}))
                elif maps and head == "VmFlags:":
                    maps[-1][3]["VmFlags"] = rest
                elif maps and rest and rest[-1] == "kB":
                    maps[-1][3][head[:-1]] = int(rest[0]) * 1024
    except OSError:
        return []
    return maps


def resident_range(address: int, nbytes: int) -> Optional[int]:
    """Bytes of [address, address + nbytes) in RAM (committed pages, counted with mincore). None
    where that cannot be told: not Linux, or part of the range is no longer mapped."""
    if not sys.platform.startswith("linux"):
        return None
    page = os.sysconf("SC_PAGE_SIZE")
    first = address - address % page
    n = (address + nbytes - first + page - 1) // page
    vec = (ctypes.c_ubyte * n)()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mincore(ctypes.c_void_p(first), ctypes.c_size_t(n * page), vec) != 0:
        return None  # ENOMEM: unmapped (e.g. freed back to the OS)
    return int((np.frombuffer(vec, dtype=np.uint8) & 1).sum()) * page


def resident_bytes(a: mx.array) -> Optional[int]:
    """Bytes of `a`'s memory that are in RAM, for measuring one buffer exactly whatever else the
    process holds (see resident_range)."""
    return resident_range(array_address(a), a.nbytes)
