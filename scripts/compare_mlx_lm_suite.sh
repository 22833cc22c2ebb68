#!/usr/bin/env bash
# mlx-lm's own test suite (shipped in its sdist) on stock mlx-lm (build/venv-stock, PyPI's MLX) and on
# the custom wheels (build/venv-fork), side by side: per test file pass/fail/error/skip/not-run,
# regressions (exit status 1 if any), the series' new tests, and the tests that cannot run offline
# with the reason. Run by hand (about as long as the suite takes twice); ci/run.sh runs the part it
# selects on the custom wheels.
# Usage: scripts/compare_mlx_lm_suite.sh [PATTERN ...]   (test file globs, e.g. 'test_prompt_cache.py')
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
ls "$root"/dist/mlx_h2o-*.whl >/dev/null 2>&1 || "$root/scripts/build_wheels.sh"
# shellcheck source=../patches/mlx-lm/pin.env
source "$root/patches/mlx-lm/pin.env"
out="$root/build/mlx-lm/suite"
mkdir -p "$out"
python3 "$root/scripts/series.py" apply mlx-lm >&2   # mlx-lm/: commit 'base' = the sdist, HEAD = + the series
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1   # fail fast instead of retrying a hub we cannot reach
for kind in stock fork; do
  py="$("$root/scripts/venv.sh" "$kind")"
  rm -rf "$out/$kind" && mkdir -p "$out/$kind"
  if [ "$kind" = stock ]; then
    "$py" -m pip install --quiet --disable-pip-version-check "mlx-lm==$MLX_LM_VERSION" 2>/dev/null
    git -C "$root/mlx-lm" archive base tests | tar -x -C "$out/$kind"
  else
    cp -R "$root/mlx-lm/tests" "$out/$kind/tests"
  fi
  echo "== $kind: mlx-lm $("$py" -c 'import mlx_lm; print(mlx_lm.__version__)'), MLX $("$py" -c 'import mlx.core as mx; print(mx.__version__)')" >&2
  nice -n 10 "$py" "$root/scripts/mlx_lm_suite.py" run "$out/$kind/tests" "$out/$kind.json" "$@" 2>"$out/$kind.log" || true
  tail -1 "$out/$kind.log" >&2
done
python3 "$root/scripts/mlx_lm_suite.py" compare "$out/stock.json" "$out/fork.json" | tee "$out/table.md"
