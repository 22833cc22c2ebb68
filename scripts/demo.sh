#!/usr/bin/env bash
# Set up and run the main job on a fresh machine: the caches a user can pick at the same bytes, on
# 2048 tokens of context, on the embedded SmolLM2-135M-Instruct: the full cache, mlx-lm's sliding
# window (RotatingKVCache), an 8-bit sliding window and h2o at a byte budget (max_kv_bytes), at
# 1/16, 1/8 and 1/4 of the full cache's bytes. Perplexity of a continuation after a long prompt,
# recall of a span seen ~1,800 tokens earlier, decode speed and peak memory; a table with a verdict
# per row and a plot (results/demo.png). Held-out documents (set 1; the defaults were chosen on set 0).
# Sets up build/venv-stock first (scripts/venv.sh: ~2 min the first time, then seconds).
set -euo pipefail
cd "$(dirname "$0")/.."
echo "demo: setting up (the evaluation text, then build/venv-stock)"
./scripts/setup_text.sh
py="$(./scripts/venv.sh stock)"
mkdir -p results
echo "demo: mlx-h2o demo (about 3-4 min on 2 cores; progress below)"
"$py" -m mlx_h2o demo --context 2048 --budget 0.0625 0.125 0.25 --json results/demo.json --plot results/demo.png "$@"
