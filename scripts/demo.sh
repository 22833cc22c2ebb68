#!/usr/bin/env bash
# Set up and run the main job on a fresh machine: full vs sliding-window vs H2O cache, side by side,
# on the embedded SmolLM2-135M-Instruct (prefill 32 tokens, then one token at a time; 4 samples).
# Sets up build/venv-stock first (scripts/venv.sh: ~3 min the first time, then seconds).
set -euo pipefail
cd "$(dirname "$0")/.."
echo "demo: setting up (the evaluation text, then build/venv-stock)"
./scripts/setup_text.sh
py="$(./scripts/venv.sh stock)"
mkdir -p results
echo "demo: mlx-h2o eval (about 5 min on 2 cores)"
"$py" -m mlx_h2o eval --kv-policy full rotating h2o --max-kv-size 128 256 --seq-len 512 --samples 4 \
  --json results/demo.json --plot results/demo.png "$@"
