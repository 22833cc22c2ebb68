#!/usr/bin/env bash
# The patched-wheel tests (scripts/test.sh runs this; CI with it), in a venv of their own
# (build/venv-patched), never the global environment:
#   1. build the wheels (scripts/build_wheels.sh) and install them with their dependencies;
#   2. the series' own tests and the quick offline part of mlx-lm's suite, from the patched tree,
#      against the installed wheel (test_models.py and test_sample_utils.py, minutes on 2 cores, run
#      in the full stock-vs-patched comparison: scripts/compare_mlx_lm_suite.sh, by hand);
#   3. our tests with the patched wheel: the mlx-lm plugin, and mlx-lm's commands and server on the
#      converted embedded model (test_convert.py runs with stock mlx-lm in scripts/test.sh).
# Usage: scripts/test_patched.sh [--no-build] [pytest args...]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
if [ "${1:-}" = "--no-build" ]; then shift; else "$root/scripts/build_wheels.sh"; fi
py="$("$root/scripts/mlx_lm_venv.sh" patched)"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
suite="$root/build/mlx-lm/suite/ci"
rm -rf "$suite" && mkdir -p "$suite" && cp -R "$root/build/mlx-lm/patched/tests" "$suite/tests"
"$py" "$root/scripts/mlx_lm_suite.py" run "$suite/tests" "$suite.json" '!test_models.py' '!test_sample_utils.py' 2>"$suite.log" \
  || { tail -50 "$suite.log"; exit 1; }
"$py" "$root/scripts/mlx_lm_suite.py" check "$suite.json"
# From a directory without src/: the installed mlx_h2o wheel is what the tests import.
cd "$root/tests"
"$py" -m pytest -q -p no:cacheprovider --rootdir "$root" -c "$root/pyproject.toml" \
  test_mlx_lm_plugin.py test_mlx_lm_commands.py "$@"
