#!/usr/bin/env bash
# mlx-lm's own test suite (shipped in its sdist) on stock and on patched mlx-lm, each in its own venv,
# side by side: per test file pass/fail/error/skip/not-run, regressions (exit status 1 if any), the
# series' new tests, and the tests that cannot run offline with the reason. Run by hand (about as long
# as the suite takes twice); CI runs the part scripts/test_patched.sh selects.
# Usage: scripts/compare_mlx_lm_suite.sh [PATTERN ...]   (test file globs, e.g. 'test_prompt_cache.py')
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
[ -d "$root/build/mlx-lm/patched/tests" ] && ls "$root"/dist/mlx_h2o-*.whl >/dev/null 2>&1 || "$root/scripts/build_wheels.sh"
stock_src="$("$root/scripts/mlx_lm_sdist.sh")"
out="$root/build/mlx-lm/suite"
mkdir -p "$out"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1   # fail fast instead of retrying a hub we cannot reach
for kind in stock patched; do
  py="$("$root/scripts/mlx_lm_venv.sh" "$kind")"
  tests=$([ "$kind" = stock ] && echo "$stock_src/tests" || echo "$root/build/mlx-lm/patched/tests")
  rm -rf "$out/$kind" && mkdir -p "$out/$kind" && cp -R "$tests" "$out/$kind/tests"
  echo "== $kind: $("$py" -c 'import mlx_lm; print(mlx_lm.__version__)')" >&2
  nice -n 10 "$py" "$root/scripts/mlx_lm_suite.py" run "$out/$kind/tests" "$out/$kind.json" "$@" 2>"$out/$kind.log" || true
  tail -1 "$out/$kind.log" >&2
done
python3 "$root/scripts/mlx_lm_suite.py" compare "$out/stock.json" "$out/patched.json" | tee "$out/table.md"
