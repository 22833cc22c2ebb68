"""Fast fp32 matmuls for MLX's CPU backend on Linux.

The mlx-cpu wheel links a reference BLAS; NumPy's wheels bundle OpenBLAS. The shim library built
with this package (csrc/blas/openblas_shim.cpp) defines the CBLAS GEMMs libmlx imports and forwards
them to NumPy's OpenBLAS. It only takes effect when loaded before libmlx, i.e. when `mlx_h2o` is
imported before `mlx.core` (the CLI, benchmarks and tests do). This module must not import MLX.

Set MLX_H2O_BLAS=reference to keep MLX's own BLAS.
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


def route_matmul_to_openblas() -> str:
    """Install the shim if possible; returns (and remembers) a description of the BLAS in use."""
    if _state["backend"] is not None:
        return _state["backend"]
    backend = _install()
    _state["backend"] = backend
    return backend


def _install() -> str:
    if not sys.platform.startswith("linux"):
        return "platform default"
    if os.environ.get("MLX_H2O_BLAS", "openblas") == "reference":
        return "mlx reference BLAS (MLX_H2O_BLAS=reference)"
    if "mlx.core" in sys.modules:
        return "mlx reference BLAS (mlx.core was imported before mlx_h2o; import mlx_h2o first for OpenBLAS)"
    openblas = _numpy_openblas()
    shim = os.path.join(os.path.dirname(__file__), "libmlx_h2o_blas.so")
    if openblas is None or not os.path.exists(shim):
        return "mlx reference BLAS (NumPy's bundled OpenBLAS or the shim not found)"
    try:
        lib = ctypes.CDLL(openblas)
        for sym in ("scipy_cblas_sgemm64_", "scipy_cblas_dgemm64_", "scipy_cblas_cgemm64_"):
            getattr(lib, sym)
        # Initialise before exposing the shim's symbols globally, so libmlx never sees it half-ready.
        local = ctypes.CDLL(shim, mode=ctypes.RTLD_LOCAL)
        if local.mlx_h2o_blas_init(openblas.encode()) != 0:
            return "mlx reference BLAS (shim initialisation failed)"
        ctypes.CDLL(shim, mode=ctypes.RTLD_GLOBAL)  # same handle, now promoted to the global scope
    except (OSError, AttributeError) as e:
        return f"mlx reference BLAS (shim unavailable: {e})"
    return f"OpenBLAS from NumPy ({os.path.basename(openblas)})"


def blas_backend() -> str:
    """Which BLAS MLX's CPU matmuls use in this process."""
    return _state["backend"] or "mlx reference BLAS (mlx_h2o._blas not initialised)"
