#!/usr/bin/env bash
# Set everything up and run the main job: generation with speculative decoding on a small model.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e .
out=${1:-/tmp/foretell-tiny}
python3 scripts/make_tiny_model.py "$out"
foretell generate --model "$out/qwen3" --prompt "The cat reads the book." --max-tokens 32 \
  --method eagle3 --draft-model "$out/qwen3_eagle3" --num-speculative-tokens 3 --stats
