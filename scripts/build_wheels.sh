#!/usr/bin/env bash
# The custom wheels, built offline into dist/ (how users get them and contributors rebuild them):
#   mlx-<tag>+h2o.N      MLX at the pinned upstream commit (the mlx/ submodule) + patches/mlx: CPU
#                        backend and Python bindings, linked with OpenBLAS     (cold ~10 min, ccache ~1 min)
#   mlx_lm-<v>+h2o.N     the pinned mlx-lm release (PyPI sdist) + patches/mlx-lm            (~30 s)
#   mlx_h2o-<v>          this package, its extension compiled against that MLX             (~3 min)
# Then: python -m venv v && v/bin/pip install dist/*.whl
# The build tools live in build/venv-build. Environment: DIST_DIR (default dist/), JOBS (default: cores).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
dist="${DIST_DIR:-$root/dist}"
export DIST_DIR="$dist"
# shellcheck source=../patches/mlx/pin.env
source patches/mlx/pin.env
venv=build/venv-build
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py="$venv/bin/python"
echo "build_wheels.sh: build tools in $venv"
"$py" -m pip install --quiet --disable-pip-version-check 'setuptools>=80' 'cmake>=3.27' typing_extensions wheel \
  packaging "$NANOBIND_REQUIREMENT" 'scikit-build-core>=0.10' 2>&1 | grep -v '^WARNING: Location' || true
"$py" scripts/series.py build mlx
"$py" scripts/series.py build mlx-lm
# mlx-h2o against the fork: no build isolation, or pip would build it against PyPI's MLX instead.
fork=("$dist"/mlx-*+"$MLX_LOCAL_VERSION"-*.whl)
"$py" -m pip install --quiet --disable-pip-version-check --force-reinstall --no-deps "${fork[0]}"
"$py" -m pip install --quiet --disable-pip-version-check numpy 2>&1 | grep -v '^WARNING: Location' || true
rm -f "$dist"/mlx_h2o-*.whl
echo "build_wheels.sh: building mlx_h2o against $(basename "${fork[0]}") (~3 min, the C++ extension)"
"$py" -m pip wheel --no-build-isolation --no-deps -v -w "$dist" . 2>&1 \
  | grep --line-buffered -E '^(Building wheel|Created wheel|ERROR|error)|\[ *[0-9]+%\]|^ *\[[0-9]+/[0-9]+\]' || true
ls "$dist"/mlx_h2o-*.whl >/dev/null || { echo "build_wheels.sh: the mlx_h2o wheel was not built" >&2; exit 1; }
echo "build_wheels.sh: built"
ls -1 "$dist"/mlx-*+"$MLX_LOCAL_VERSION"-*.whl "$dist"/mlx_lm-*.whl "$dist"/mlx_h2o-*.whl
