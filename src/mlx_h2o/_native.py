"""The C++ extension, loaded once and checked: mlx.core first (it loads libmlx and registers the
nanobind types `_ext` passes across), then `_ext`, refused if built against another MLX minor."""

import importlib

import mlx.core  # noqa: F401  (before the extension)

_ext = importlib.import_module(f"{__package__}._ext")

from ._version_check import check_extension  # noqa: E402

check_extension(_ext.built_with_mlx)

__all__ = ["_ext"]
