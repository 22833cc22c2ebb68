# Sourced by scripts/build_mlx.sh and scripts/regen_mlx_patches.sh: the pin of the MLX patch series
# (patches/mlx/pin.env), error exits, and the MLX clone named on the command line.
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
series_dir="$root/patches/mlx"
# shellcheck source=../patches/mlx/pin.env
source "$series_dir/pin.env"

die() {
  echo "$(basename "$0"): $*" >&2
  exit 1
}

# open_src "$@" <<<USAGE: with exactly one argument, sets src to that MLX clone (a git work tree);
# otherwise prints USAGE (read from stdin) and exits 2.
open_src() {
  if [ $# -ne 1 ]; then
    cat >&2
    exit 2
  fi
  src="$(cd "$1" 2>/dev/null && pwd)" || die "no such directory: $1"
  git_src rev-parse --is-inside-work-tree >/dev/null 2>&1 || die "$src is not a git work tree (a clone of ml-explore/mlx)"
}

git_src() { git -C "$src" "$@"; }

# require_clean WHY: fails unless the clone's tracked files match HEAD.
require_clean() {
  git_src diff --quiet HEAD -- && git_src diff --cached --quiet HEAD -- || die "$src has uncommitted changes to tracked files; $1"
}
