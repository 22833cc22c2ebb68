"""Refuse to run an extension built against another MLX minor version (its C++ ABI is not stable)."""

import warnings

import mlx.core as mx


def check_extension(built_with: str) -> None:
    running = mx.__version__
    if built_with.split(".")[:2] != running.split(".")[:2]:
        raise ImportError(
            f"mlx_h2o's C++ extension was built against MLX {built_with} but MLX {running} is installed; "
            "rebuild it: pip install --force-reinstall --no-deps --no-cache-dir mlx-h2o (or `pip install .` "
            "from a checkout)."
        )
    if built_with != running:
        warnings.warn(
            f"mlx_h2o was built against MLX {built_with}, running with {running}; rebuild if ops misbehave.",
            RuntimeWarning,
            stacklevel=3,
        )
