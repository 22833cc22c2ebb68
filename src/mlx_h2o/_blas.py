"""Fast fp32 matmuls for MLX's CPU backend on Linux.

The mlx-cpu wheel links a reference BLAS; NumPy's wheels bundle OpenBLAS. The shim library built
with this package (csrc/blas/openblas_shim.cpp) defines the CBLAS GEMMs libmlx imports and forwards
them to NumPy's OpenBLAS. It changes MLX for the whole process, so it is opt-in: `use_openblas()`
before anything imports mlx.core (importing mlx_h2o does not), or MLX_H2O_BLAS=openblas in the
environment. The `mlx-h2o` command opts in and says so. The fork's MLX wheel (scripts/series.py
build mlx) links OpenBLAS itself and needs no shim. This module must not import MLX.

OpenBLAS's threads spin after each call before they sleep. Decode runs no GEMM, so after a prefill
they spun beside the decode kernels' two threads on a 2-core machine: the steps then were the slowest
of a decode (p99 / p50 of the step time 1.39-1.55 against 1.17-1.20 with them asleep at once,
docs/cpu-decode.md). Opting in also sets OPENBLAS_THREAD_TIMEOUT (where it is not set already),
which the OpenBLAS loaded next reads: its threads sleep after 2^4 cycles of waiting.
"""

import ctypes
import glob
import importlib.util
import os
import sys

_state = {"backend": None}


def _numpy_openblas():
    spec = importlib.util.find_spec("numpy")  # locates NumPy without importing it
    if spec is None or not spec.origin:
        return None
    root = os.path.dirname(os.path.dirname(spec.origin))
    found = sorted(glob.glob(os.path.join(root, "numpy.libs", "libscipy_openblas64_*.so")))
    return found[0] if found else None


def use_openblas() -> str:
    """Route MLX's CPU GEMMs to NumPy's OpenBLAS for this process, where possible: only before
    mlx.core is imported, on Linux. Returns (and remembers) a description of the BLAS in use."""
    if _state["backend"] is not None:
        return _state["backend"]
    backend = _install()
    _state["backend"] = backend
    return backend


# OpenBLAS's spin before a thread sleeps, as 2^N cycles (its smallest): module docstring.
OPENBLAS_THREAD_TIMEOUT = "4"


def _install() -> str:
    if not sys.platform.startswith("linux"):
        return "platform default"
    if os.environ.get("MLX_H2O_BLAS") == "reference":
        return "MLX's own BLAS (MLX_H2O_BLAS=reference)"
    if "mlx.core" in sys.modules:
        return "MLX's own BLAS (mlx.core was imported before use_openblas())"
    # Before any OpenBLAS of this process loads (NumPy's through the shim, or the one the fork's MLX links).
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", OPENBLAS_THREAD_TIMEOUT)
    openblas = _numpy_openblas()
    shim = os.path.join(os.path.dirname(__file__), "libmlx_h2o_blas.so")
    if openblas is None or not os.path.exists(shim):
        return "MLX's own BLAS (NumPy's bundled OpenBLAS or the shim not found)"
    try:
        lib = ctypes.CDLL(openblas)
        for sym in ("scipy_cblas_sgemm64_", "scipy_cblas_dgemm64_", "scipy_cblas_cgemm64_"):
            getattr(lib, sym)
        # Initialise before exposing the shim's symbols globally, so libmlx never sees it half-ready.
        local = ctypes.CDLL(shim, mode=ctypes.RTLD_LOCAL)
        if local.mlx_h2o_blas_init(openblas.encode()) != 0:
            return "MLX's own BLAS (shim initialisation failed)"
        ctypes.CDLL(shim, mode=ctypes.RTLD_GLOBAL)  # same handle, now promoted to the global scope
    except (OSError, AttributeError) as e:
        return f"MLX's own BLAS (shim unavailable: {e})"
    return f"OpenBLAS from NumPy ({os.path.basename(openblas)})"


def blas_backend() -> str:
    """Which BLAS MLX's CPU matmuls use in this process."""
    return _state["backend"] or "MLX's own BLAS (use_openblas() not called)"
