#!/usr/bin/env bash
# Build the extension in place (src/mlx_h2o/_ext*.so) for development: PYTHONPATH=src pytest.
# Each git worktree gets its own build/ folder, so parallel checkouts do not collide.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
# The build needs what pyproject's build-system names: MLX (headers + CMake config), nanobind 3.x, CMake >= 3.27.
"$py" -c "import mlx.core, nanobind" 2>/dev/null || "$py" -m pip install --quiet "nanobind>=3,<4" "mlx[cpu]>=0.32.4,<0.33"
# BUILD_TYPE=RelWithDebInfo keeps the symbols (Release strips them) for perf: benchmarks/profile_decode.py.
cmake -S . -B build/dev -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-Release}" -DPython_EXECUTABLE="$(command -v "$py")" >/dev/null
cmake --build build/dev -j "$(nproc)"
# Replace by rename, never in place: a running process keeps its mapping of the old file (overwriting
# a loaded shared library crashes it).
for lib in build/dev/_ext*.so build/dev/libmlx_h2o_blas.so; do
  [ -f "$lib" ] || continue
  cp "$lib" "src/mlx_h2o/.$(basename "$lib").new" && mv -f "src/mlx_h2o/.$(basename "$lib").new" "src/mlx_h2o/$(basename "$lib")"
done
echo "built $(ls src/mlx_h2o/_ext*.so)"
