#!/usr/bin/env bash
# The contributor's loop for the MLX patch series: edit MLX in a clone, one commit per patch on top
# of the pinned tag, then regenerate patches/mlx/*.patch from those commits (one file per commit, in
# order). Build and test the result with scripts/build_mlx.sh.
#
# Usage: scripts/regen_mlx_patches.sh SRC_DIR
#   SRC_DIR  a clone of ml-explore/mlx whose HEAD is the pinned tag plus the series' commits.
#            To start from the current series:
#              git -C SRC_DIR checkout -b h2o-series v0.32.1 && git -C SRC_DIR am "$PWD"/patches/mlx/*.patch
set -euo pipefail
# shellcheck source=mlx_fork_env.sh
source "$(dirname "$0")/mlx_fork_env.sh"

open_src "$@" <<EOF
usage: scripts/regen_mlx_patches.sh SRC_DIR
SRC_DIR: a clone of ml-explore/mlx with the series as commits on top of $MLX_TAG, e.g.
  git -C SRC_DIR checkout -b h2o-series $MLX_TAG && git -C SRC_DIR am $series_dir/*.patch
EOF

git_src cat-file -e "$MLX_COMMIT^{commit}" 2>/dev/null || die "$src does not have $MLX_TAG ($MLX_COMMIT)"
git_src merge-base --is-ancestor "$MLX_COMMIT" HEAD || die "HEAD of $src is not based on $MLX_TAG ($MLX_COMMIT)"
require_clean "commit them (one commit per patch) first"
[ -z "$(git_src rev-list --merges "$MLX_COMMIT"..HEAD)" ] || die "the series must be linear (no merge commits)"
count="$(git_src rev-list --count "$MLX_COMMIT"..HEAD)"
[ "$count" -gt 0 ] || die "no commits on top of $MLX_TAG: nothing to write"

# Only our diffs leave the clone: the commits' changes with their context lines, nothing else.
# --zero-commit / --no-signature / no numbering in subjects: regenerating an unchanged series gives
# byte-identical files, so the diff of patches/mlx shows only real changes.
rm -f "$series_dir"/*.patch
git_src format-patch --quiet --zero-commit --no-signature --no-numbered \
  -o "$series_dir" "$MLX_COMMIT"..HEAD
echo "regen_mlx_patches.sh: wrote $count patches on top of $MLX_TAG to ${series_dir#"$root"/}:"
for p in "$series_dir"/*.patch; do echo "  $(basename "$p")"; done
