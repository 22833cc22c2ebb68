#!/usr/bin/env bash
# Build the custom wheels into dist/ (also how contributors rebuild from source):
#   mlx_lm-<version>+h2o.<revision>-py3-none-any.whl: the pinned mlx-lm sdist (patches/mlx-lm/pin.env),
#       hash-checked, with the series patches/mlx-lm/NNNN-*.patch applied in order;
#   mlx_h2o-<version>-<tag>.whl: this package, with its C++ extension.
# Then: pip install dist/*.whl
# Usage: scripts/build_wheels.sh [--mlx-lm-only]     (PYTHON=... picks the interpreter)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
py=${PYTHON:-python3}
# shellcheck source=../patches/mlx-lm/pin.env
source "$root/patches/mlx-lm/pin.env"
version="$MLX_LM_VERSION+h2o.$MLX_LM_SERIES_REVISION"
src="$("$root/scripts/mlx_lm_sdist.sh")"   # downloads (once) and verifies the sha256
work="$root/build/mlx-lm/patched"
rm -rf "$work"
cp -R --no-preserve=ownership "$src" "$work"
rm -f "$work/.unpacked"
git -C "$work" init --quiet   # its own repository: git apply resolves paths against it, not ours

shopt -s nullglob
patches=("$root"/patches/mlx-lm/[0-9][0-9][0-9][0-9]-*.patch)
[ ${#patches[@]} -gt 0 ] || { echo "build_wheels.sh: no patches in patches/mlx-lm/" >&2; exit 1; }
for p in "${patches[@]}"; do
  if ! log="$(git -C "$work" apply --check --verbose "$p" 2>&1)"; then
    echo "build_wheels.sh: $(basename "$p") does not apply to mlx-lm $MLX_LM_VERSION; the hunk that fails:" >&2
    if grep -q '^error: while searching for:' <<<"$log"; then
      sed -n '/^error: while searching for:/,$p' <<<"$log" >&2
    else
      echo "$log" >&2
    fi
    exit 1
  fi
  git -C "$work" apply "$p"
  echo "applied $(basename "$p")"
done

mkdir -p "$root/dist"
rm -f "$root"/dist/mlx_lm-*.whl
# setuptools-scm writes mlx_lm/_version.py from this: mlx_lm.__version__ names the series.
SETUPTOOLS_SCM_PRETEND_VERSION="$version" "$py" -m pip wheel --quiet --no-deps -w "$root/dist" "$work"
wheel="$root/dist/mlx_lm-$version-py3-none-any.whl"
[ -f "$wheel" ] || { echo "build_wheels.sh: expected $wheel" >&2; ls "$root/dist" >&2; exit 1; }
"$py" - "$wheel" "$version" <<'PYEOF'
import sys, zipfile
wheel, version = sys.argv[1:]
text = zipfile.ZipFile(wheel).read("mlx_lm/_version.py").decode()
if repr(version) not in text:
    sys.exit(f"build_wheels.sh: {wheel} says {text.strip()!r}, expected __version__ = {version!r}")
PYEOF
echo "built $wheel"

if [ "${1:-}" != "--mlx-lm-only" ]; then
  rm -f "$root"/dist/mlx_h2o-*.whl
  "$py" -m pip wheel --quiet --no-deps -w "$root/dist" "$root"
  echo "built $(ls "$root"/dist/mlx_h2o-*.whl)"
fi
