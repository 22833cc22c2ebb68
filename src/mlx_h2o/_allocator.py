"""Large buffers in their own memory maps, returned to the system when freed (glibc).

MLX's CPU allocator takes each buffer from `malloc` (keeping up to 32 MB of freed ones for reuse).
glibc serves a request of more than its mmap threshold with a mapping of its own, but the threshold
starts at 128 KiB and rises to the size of every such mapping freed, up to 32 MiB. A KV cache grows in
steps and a prefill frees large temporaries, so after the first such mapping is freed the rest come
from the heap, and freed heap memory stays with the process: after a 2048-token prefill and decode
of the embedded SmolLM2, over a quarter of the process's resident memory (benchmarks/audit_memory.py,
docs/cpu-decode.md "Memory: every buffer above 1 MiB"). `use_mmap_for_large_buffers()` fixes the
threshold, so every buffer above it is its own mapping again and goes back to the system when MLX
frees it.

The price was a prefill's: every large allocation that misses MLX's buffer cache maps and faults in
fresh pages, and an h2o prefill's attention then took up to 32 MiB of scratch per call (~15 % slower).
The kernels now keep that scratch from one call to the next (csrc/kernels/work.h, KeptFloats).

MLX's own cache of freed buffers is the other half (`limit_mlx_buffer_cache()`): it reuses a buffer
only for a request of about its size, so a prefill layer's temporaries of every size it frees stay
beside the live ones. The commands keep it to 1 MiB.

Both change the whole process, so importing mlx_h2o calls neither: the commands that own their
process do (`mlx-h2o`, `python -m mlx_h2o.run_mlx_lm`), as they opt in to OpenBLAS.
MLX_H2O_ALLOCATOR=glibc in the environment keeps both allocators as they come. Importing this module
must not import MLX.
"""

import ctypes
import os
import sys

DEFAULT_THRESHOLD = 128 * 1024  # glibc's own starting threshold, kept fixed
MAX_THRESHOLD = 32 * 1024 * 1024  # glibc's largest on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
_M_MMAP_THRESHOLD = -3  # mallopt's parameter (malloc.h)

# Bytes of freed buffers MLX keeps for reuse in the commands' processes (MLX's own default: 32 MiB).
# On the embedded model a 1 MiB limit takes ~12 MiB off a 512-token prompt's peak RSS and ~30 MiB
# off a 2048-token one's, and costs a prefill ~10 % (its larger temporaries faulted in afresh each
# layer); decode unchanged (benchmarks/bench_buffer_cache.py, docs/cpu-decode.md).
MLX_BUFFER_CACHE_LIMIT = 1 << 20

_state = {"threshold": None, "mlx_cache_limit": None}


def _opted_out() -> bool:
    """MLX_H2O_ALLOCATOR=glibc: keep the C allocator as it comes, whoever calls for the threshold."""
    return os.environ.get("MLX_H2O_ALLOCATOR") == "glibc"


def use_mmap_for_large_buffers(threshold: int = DEFAULT_THRESHOLD) -> bool:
    """Serve every allocation of more than `threshold` bytes (4 KiB to 32 MiB) from its own memory
    map for the rest of this process, so that freed buffers go back to the system instead of staying
    in the heap. Returns whether it took effect (glibc on Linux, unless MLX_H2O_ALLOCATOR=glibc)."""
    if isinstance(threshold, bool) or not isinstance(threshold, int) or not 4096 <= threshold <= MAX_THRESHOLD:
        raise ValueError(f"threshold must be an integer number of bytes from 4096 to {MAX_THRESHOLD}, got {threshold!r}")
    if not sys.platform.startswith("linux") or _opted_out():
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # glibc (musl has no mallopt parameters)
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(_M_MMAP_THRESHOLD, threshold) != 1:
        return False
    _state["threshold"] = threshold
    return True


def limit_mlx_buffer_cache(limit: int = MLX_BUFFER_CACHE_LIMIT) -> bool:
    """Let MLX keep at most `limit` bytes of freed buffers for reuse (`mx.set_cache_limit`) for the
    rest of this process. Returns whether it took effect (not under MLX_H2O_ALLOCATOR=glibc). It
    loads MLX: call it after `use_openblas()`."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise ValueError(f"limit must be a number of bytes, an integer >= 0, got {limit!r}")
    if _opted_out():
        return False
    import mlx.core as mx

    mx.set_cache_limit(limit)
    _state["mlx_cache_limit"] = limit
    return True


def mmap_threshold():
    """The threshold `use_mmap_for_large_buffers` fixed in this process, or None (the C allocator's own)."""
    return _state["threshold"]


def allocator_description() -> str:
    """What this process's large buffers come from, for the commands' one-line report."""
    threshold, limit = _state["threshold"], _state["mlx_cache_limit"]
    if threshold is not None:
        large = f"own maps above {threshold // 1024} KiB (freed to the system)"
    elif _opted_out():
        large = "the C allocator's own (MLX_H2O_ALLOCATOR=glibc)"
    else:
        large = "the C allocator's own"
    # (the limit holds where the C allocator has no mmap threshold to fix, e.g. on macOS)
    return large if limit is None else f"{large}; MLX keeps {limit / 2**20:g} MiB of freed ones"


def give_back_free_heap() -> None:
    """Return the C heap's free pages to the system (glibc's `malloc_trim`; elsewhere nothing). It
    changes no allocator setting: memory already freed stops counting as the process's. A GGUF load
    builds its tokenizer from ~100k Python strings and frees them (~45 MiB for a moment)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
