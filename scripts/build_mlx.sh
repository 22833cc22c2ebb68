#!/usr/bin/env bash
# Build a patched MLX wheel from source, offline: check out the tag pinned in patches/mlx/pin.env,
# apply patches/mlx/*.patch in order, build the CPU backend + Python bindings, and write
# dist/mlx-<version>+<label>-*.whl. Re-runs reuse the build directory (SRC_DIR/build) and ccache.
#
# Usage: scripts/build_mlx.sh SRC_DIR
#   SRC_DIR        a clone of ml-explore/mlx (any branch; the script moves it to the tag + series)
# Environment:
#   PYTHON         interpreter whose environment holds the build tools (default: python3); the
#                  wheel is only built, never installed. Use a venv (see docs/mlx-fork.md).
#   MLX_GGUF_SRC   a clone of antirez/gguf-tools holding GGUFLIB_COMMIT (GGUF support; required
#                  unless MLX_BUILD_GGUF=OFF)
#   MLX_BUILD_GGUF ON (default) or OFF: OFF builds a wheel whose mx.load cannot read .gguf files
#   JOBS           parallel compile jobs (default 2)
#   DIST_DIR       where the wheel goes (default: dist/ of this repository)
#
# Network: none. Every dependency MLX's CMake would download comes from the machine: Debian
# packages (nlohmann-json3-dev, libfmt-dev, BLAS/LAPACK), pip's nanobind, the gguf-tools clone.
set -euo pipefail
# shellcheck source=mlx_fork_env.sh
source "$(dirname "$0")/mlx_fork_env.sh"

open_src "$@" <<EOF
usage: scripts/build_mlx.sh SRC_DIR

SRC_DIR is a clone of MLX's source, which no package registry carries. Get one with
  git clone https://github.com/ml-explore/mlx.git SRC_DIR
(or clone an existing local copy); it must contain the tag $MLX_TAG ($MLX_COMMIT).
GGUF support also needs gguflib's source:
  git clone https://github.com/antirez/gguf-tools.git DIR && export MLX_GGUF_SRC=DIR
See docs/mlx-fork.md.
EOF
py="${PYTHON:-python3}"
jobs="${JOBS:-2}"
dist="${DIST_DIR:-$root/dist}"
gguf="${MLX_BUILD_GGUF:-ON}"

# ---- 1. The machine: Debian packages and Python build tools --------------------------------------
missing=()
if command -v dpkg-query >/dev/null; then
  for pkg in g++ make nlohmann-json3-dev libfmt-dev libblas-dev liblapack-dev liblapacke-dev; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
else
  echo "build_mlx.sh: not Debian: cannot check for the packages; the build needs a C++20 compiler, make," \
    "nlohmann/json.hpp in /usr/include, fmt's CMake package, CBLAS/LAPACK(E)" >&2
fi
if [ ${#missing[@]} -gt 0 ]; then
  die "missing Debian packages: ${missing[*]}
  install them with: apt-get install -y ${missing[*]} ccache   (ccache: optional, makes rebuilds cheap)"
fi
command -v ccache >/dev/null || echo "build_mlx.sh: ccache not found; every build compiles from scratch (apt-get install ccache)" >&2
"$py" - "$NANOBIND_REQUIREMENT" <<'EOF' || die "the build tools are missing from $py's environment; install them with:
  $py -m pip install 'setuptools>=80' 'cmake>=3.25' typing_extensions '$NANOBIND_REQUIREMENT'"
import sys
from importlib.metadata import version
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
reqs = ["setuptools>=80", "cmake>=3.25", "typing_extensions", sys.argv[1]]
bad = []
for r in map(Requirement, reqs):
    try:
        v = version(r.name)
    except Exception:
        bad.append(f"{r} (not installed)")
        continue
    if not r.specifier.contains(v, prereleases=True):
        bad.append(f"{r} (found {v})")
if bad:
    print("build_mlx.sh: needs " + ", ".join(bad), file=sys.stderr)
    sys.exit(1)
EOF

# ---- 2. The source: tag + series -----------------------------------------------------------------
tag_commit="$(git_src rev-parse -q --verify "refs/tags/$MLX_TAG^{commit}" || true)"
[ -n "$tag_commit" ] || die "$src has no tag $MLX_TAG (git -C $src fetch --tags, or clone ml-explore/mlx again)"
[ "$tag_commit" = "$MLX_COMMIT" ] || die "tag $MLX_TAG resolves to $tag_commit in $src, not the pinned $MLX_COMMIT (patches/mlx/pin.env)"

patches=("$series_dir"/*.patch)
[ -e "${patches[0]}" ] || patches=()
index="$(mktemp)"
trap 'rm -f "$index"' EXIT
GIT_INDEX_FILE="$index" git_src read-tree "$MLX_COMMIT"
for p in "${patches[@]}"; do
  # --check first: a patch that does not apply names itself and shows git's message for the hunk.
  if ! msg="$(GIT_INDEX_FILE="$index" git_src apply --cached --check "$p" 2>&1)"; then
    die "patch $(basename "$p") does not apply to $MLX_TAG + the patches before it:
$msg"
  fi
  GIT_INDEX_FILE="$index" git_src apply --cached "$p"
done
tree="$(GIT_INDEX_FILE="$index" git_src write-tree)"
if [ "$(git_src rev-parse 'HEAD^{tree}')" != "$tree" ]; then
  require_clean "commit or stash them first (the build checks out $MLX_TAG + the series)"
  # A fixed identity and date make the commit id a function of the tag and the series alone.
  commit="$(GIT_AUTHOR_NAME=mlx-h2o GIT_AUTHOR_EMAIL=mlx-h2o@localhost GIT_AUTHOR_DATE='2000-01-01T00:00:00Z' \
    GIT_COMMITTER_NAME=mlx-h2o GIT_COMMITTER_EMAIL=mlx-h2o@localhost GIT_COMMITTER_DATE='2000-01-01T00:00:00Z' \
    git_src commit-tree "$tree" -p "$MLX_COMMIT" -m "$MLX_TAG + mlx-h2o series (${#patches[@]} patches)")"
  # Only the files that differ are rewritten, so unchanged sources keep their timestamps.
  git_src checkout -q --detach "$commit"
  echo "build_mlx.sh: $src now at $(git_src rev-parse --short HEAD) = $MLX_TAG + ${#patches[@]} patches"
else
  echo "build_mlx.sh: $src already holds $MLX_TAG + the series (HEAD $(git_src rev-parse --short HEAD))"
fi

# ---- 3. Offline dependencies ---------------------------------------------------------------------
deps="$src/build/h2o-deps"
mkdir -p "$deps/json/single_include"
# MLX includes <json.hpp> from <json source>/single_include/nlohmann; Debian's header tree has it.
ln -sfn /usr/include/nlohmann "$deps/json/single_include/nlohmann"
cmake_args=(
  -DMLX_BUILD_METAL=OFF -DMLX_BUILD_CUDA=OFF -DMLX_BUILD_CPU=ON
  -DUSE_SYSTEM_FMT=ON
  -DFETCHCONTENT_FULLY_DISCONNECTED=ON
  -DFETCHCONTENT_TRY_FIND_PACKAGE_MODE=ALWAYS
  "-DFETCHCONTENT_SOURCE_DIR_JSON=$deps/json"
  "-Dnanobind_DIR=$("$py" -m nanobind --cmake_dir)"
)
if [ "$gguf" = ON ]; then
  pinned="$(grep -A3 'gguflib' "$src/mlx/io/CMakeLists.txt" | sed -n 's/.*GIT_TAG \([0-9a-f]\{40\}\).*/\1/p')"
  [ "$pinned" = "$GGUFLIB_COMMIT" ] \
    || die "the tree's mlx/io/CMakeLists.txt pins gguflib ${pinned:-?}, pin.env says $GGUFLIB_COMMIT"
  [ -n "${MLX_GGUF_SRC:-}" ] || die "GGUF support needs gguflib's source: set MLX_GGUF_SRC to a clone of
  https://github.com/antirez/gguf-tools holding $GGUFLIB_COMMIT (or MLX_BUILD_GGUF=OFF for a wheel without GGUF)"
  git -C "$MLX_GGUF_SRC" cat-file -e "$GGUFLIB_COMMIT^{commit}" 2>/dev/null \
    || die "$MLX_GGUF_SRC has no commit $GGUFLIB_COMMIT (a clone of antirez/gguf-tools?)"
  if [ "$(cat "$deps/gguflib.commit" 2>/dev/null)" != "$GGUFLIB_COMMIT" ]; then
    rm -rf "$deps/gguflib" && mkdir -p "$deps/gguflib"
    git -C "$MLX_GGUF_SRC" archive "$GGUFLIB_COMMIT" | tar -x -C "$deps/gguflib"
    echo "$GGUFLIB_COMMIT" >"$deps/gguflib.commit"
  fi
  # Explicit ON: CMake's cache would otherwise keep an OFF from an earlier run.
  cmake_args+=(-DMLX_BUILD_GGUF=ON "-DFETCHCONTENT_SOURCE_DIR_GGUFLIB=$deps/gguflib")
elif [ "$gguf" = OFF ]; then
  echo "build_mlx.sh: MLX_BUILD_GGUF=OFF: this wheel's mx.load cannot read .gguf files" >&2
  cmake_args+=(-DMLX_BUILD_GGUF=OFF)
else
  die "MLX_BUILD_GGUF must be ON or OFF, got '$gguf'"
fi

# ---- 4. Build the wheel --------------------------------------------------------------------------
# setup.py: PYPI_RELEASE=1 gives the plain x.y.z of mlx/version.h; setuptools' egg_info.tag_build
# (read from DIST_EXTRA_CONFIG) appends the local label, which setup.py also passes to CMake as
# MLX_VERSION, so mx.__version__ carries it too.
tag_version="$(sed -n 's/^#define MLX_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\)$/\2/p' "$src/mlx/version.h" | paste -sd.)"
version="$tag_version+$MLX_LOCAL_VERSION"
cfg="$src/build/h2o-setup.cfg"
printf '[egg_info]\ntag_build = +%s\n' "$MLX_LOCAL_VERSION" >"$cfg"
mkdir -p "$dist"
log="$src/build/h2o-build.log"
echo "build_mlx.sh: building mlx $version (CPU, Python bindings, GGUF $gguf) with -j$jobs; log: $log"
start=$(date +%s)
if ! (cd "$src" && env PYPI_RELEASE=1 DEV_RELEASE=0 DIST_EXTRA_CONFIG="$cfg" CMAKE_BUILD_PARALLEL_LEVEL="$jobs" \
  CMAKE_ARGS="${cmake_args[*]}" nice -n 10 "$py" -m pip wheel --no-build-isolation --no-deps --no-index \
  -v -w "$dist" . >"$log" 2>&1); then
  tail -n 40 "$log" >&2
  die "the build failed (full log: $log)"
fi
elapsed=$(($(date +%s) - start))
wheel="$(ls -t "$dist"/mlx-"$version"-*.whl 2>/dev/null | head -n 1)"
[ -n "$wheel" ] || die "pip reported success but left no mlx-$version wheel in $dist"

echo "built:    $wheel"
echo "version:  $version   sha256 $(sha256sum "$wheel" | cut -d' ' -f1)"
echo "source:   $MLX_TAG ($MLX_COMMIT) + ${#patches[@]} patches -> $(git_src rev-parse HEAD)"
for p in "${patches[@]}"; do echo "          $(basename "$p")"; done
echo "time:     ${elapsed}s (-j$jobs; ccache: $(command -v ccache >/dev/null && echo on || echo off))"
