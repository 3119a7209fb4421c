#!/usr/bin/env bash
# Set everything up and run the main job: generation with EAGLE3 speculative decoding on the
# default model family that ships in foretell/default_models (no --model needed).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e .
foretell generate --prompt "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether?" \
  --max-tokens 64 --num-cpu-threads 1 --stats
