#!/usr/bin/env bash
# Fetch the pinned mlx-lm sdist from PyPI (once), verify its sha256, unpack it, and print the path of
# the unpacked source tree (build/mlx-lm/mlx_lm-<version>). Used by the wheel build and by the tests
# that run mlx-lm's own test suite. Usage: scripts/mlx_lm_sdist.sh [--print-archive]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
# shellcheck source=../patches/mlx-lm/pin.env
source "$root/patches/mlx-lm/pin.env"
dest="$root/build/mlx-lm"
archive="$dest/mlx_lm-$MLX_LM_VERSION.tar.gz"
tree="$dest/mlx_lm-$MLX_LM_VERSION"
mkdir -p "$dest"
verify() { echo "$MLX_LM_SHA256  $1" | sha256sum --check --status; }
if [ ! -f "$archive" ] || ! verify "$archive"; then
  rm -f "$archive"
  python3 -m pip download --quiet --no-deps --no-binary :all: "mlx-lm==$MLX_LM_VERSION" -d "$dest" >&2
  if ! verify "$archive"; then
    echo "mlx_lm_sdist.sh: $archive does not match the pinned sha256 $MLX_LM_SHA256 (patches/mlx-lm/pin.env)" >&2
    exit 1
  fi
fi
if [ "${1:-}" = "--print-archive" ]; then
  echo "$archive"
  exit 0
fi
if [ ! -f "$tree/.unpacked" ]; then
  rm -rf "$tree"
  tar -xzf "$archive" -C "$dest"
  touch "$tree/.unpacked"
fi
echo "$tree"
