#!/usr/bin/env bash
# The contributor's loop over the mlx-lm patch series (patches/mlx-lm/NNNN-*.patch):
#
#   scripts/mlx_lm_patches.sh tree     # build/mlx-lm/tree: a git repo of the pinned sdist (commit "base"),
#                                      # one commit per patch on top; prints its path
#   (edit there; amend the commit of the patch you change, or add commits for new patches)
#   scripts/mlx_lm_patches.sh export   # regenerate patches/mlx-lm/*.patch from the tree's commits
#   ./scripts/build_wheels.sh          # rebuild the wheels from the regenerated series
#
# `tree` refuses to overwrite a tree with uncommitted edits or commits not yet exported (--force does).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
series="$root/patches/mlx-lm"
tree="$root/build/mlx-lm/tree"
git_() { git -C "$tree" -c user.name=mlx-h2o -c user.email=mlx-h2o@localhost -c commit.gpgsign=false "$@"; }

cmd_tree() {
  if [ -d "$tree/.git" ] && [ "${1:-}" != "--force" ]; then
    if [ -n "$(git_ status --porcelain)" ]; then
      echo "mlx_lm_patches.sh: $tree has uncommitted edits; commit and export them, or pass --force" >&2
      exit 1
    fi
  fi
  src="$("$root/scripts/mlx_lm_sdist.sh")"
  rm -rf "$tree"
  cp -R --no-preserve=ownership "$src" "$tree"
  rm -f "$tree/.unpacked"
  git -C "$tree" init --quiet
  git_ add --all
  git_ commit --quiet -m "base: mlx-lm sdist $(basename "$src")"
  git_ tag base
  shopt -s nullglob
  for p in "$series"/[0-9][0-9][0-9][0-9]-*.patch; do
    if ! git_ am --quiet --3way "$p"; then
      git_ am --abort || true
      echo "mlx_lm_patches.sh: $(basename "$p") does not apply to $(basename "$src")" >&2
      exit 1
    fi
  done
  echo "$tree"
}

cmd_export() {
  [ -d "$tree/.git" ] || { echo "mlx_lm_patches.sh: no tree at $tree; run 'tree' first" >&2; exit 1; }
  if [ -n "$(git_ status --porcelain)" ]; then
    echo "mlx_lm_patches.sh: $tree has uncommitted edits; commit them first" >&2
    exit 1
  fi
  rm -f "$series"/[0-9][0-9][0-9][0-9]-*.patch
  # --zero-commit and no signature: the files change only when a patch does.
  git_ format-patch --quiet --zero-commit --no-signature --no-stat -o "$series" base..HEAD
  ls "$series"/*.patch
  echo "Bump MLX_LM_SERIES_REVISION in patches/mlx-lm/pin.env if a patch changed." >&2
}

case "${1:-}" in
  tree) shift; cmd_tree "$@" ;;
  export) cmd_export ;;
  *) echo "usage: scripts/mlx_lm_patches.sh tree [--force] | export" >&2; exit 2 ;;
esac
